"""The footprint benchmark (benchmarks/window.py) on a small window: the real caches hold the
whole context under full allocation and only about one window under window-aware allocation
when every layer is windowed; a hybrid model (a full layer beside windowed ones) gives back its
windowed layers' pages on vmem per-layer and keeps every unit elsewhere."""
from vmemkv.benchmarks.window import run_one

BYTES_PER_TOKEN = 2 * 4 * 8 * 128 * 2     # 4 layers, 8 KV heads x 128, fp16, K and V


def test_window_aware_caches_hold_one_window_where_full_ones_hold_the_context():
    window = 64
    for kind, layout in (("vmem", "per-layer"), ("vmem", "interleaved"), ("paged", "per-layer")):
        full = run_one(kind, layout, 4, (True,) * 4, window, aware=False)
        aware = run_one(kind, layout, 4, (True,) * 4, window, aware=True)
        for ctx in (4 * window, 16 * window):
            assert full[ctx] == ctx * BYTES_PER_TOKEN, (kind, layout)
            assert window * BYTES_PER_TOKEN <= aware[ctx] <= (window + 32) * BYTES_PER_TOKEN


def test_a_hybrid_model_gives_back_its_windowed_layers_on_vmem_per_layer_and_paged():
    """Per-layer: the full layer holds the context, the 5 windowed ones their window (window and
    contexts are whole pages of 32 tokens: at the mark the window lies on the last page(s)).
    Paged: one block table per layer (6 groups of 1), the windowed ones hold their window's
    blocks. Interleaved pages serve every layer at once: they keep every unit."""
    window, hybrid, layer_bytes = 64, (True,) * 5 + (False,), BYTES_PER_TOKEN // 4  # one layer's K+V
    aware = run_one("vmem", "per-layer", 6, hybrid, window, aware=True)
    full = run_one("vmem", "per-layer", 6, hybrid, window, aware=False)
    for ctx in (4 * window, 16 * window):
        assert full[ctx] == 6 * ctx * layer_bytes
        assert aware[ctx] == (ctx + 5 * window) * layer_bytes
    assert run_one("vmem", "interleaved", 6, hybrid, 32, aware=True) == \
        run_one("vmem", "interleaved", 6, hybrid, 32, aware=False)
    paged = run_one("paged", "per-layer", 6, hybrid, 32, aware=True)
    paged_full = run_one("paged", "per-layer", 6, hybrid, 32, aware=False)
    for ctx in (128, 512):       # blocks of 16: a 32-token window is two whole blocks
        assert paged_full[ctx] == 6 * ctx * layer_bytes
        assert paged[ctx] == (ctx + 5 * 32) * layer_bytes
