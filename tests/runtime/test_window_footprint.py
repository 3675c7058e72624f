"""The footprint benchmark (benchmarks/window.py) on a small window: the real caches hold the
whole context under full allocation and only about one window under window-aware allocation
when every layer is windowed; a hybrid model (a full layer beside windowed ones) keeps it all."""
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


def test_a_hybrid_model_keeps_every_unit():
    hybrid = (True,) * 5 + (False,)
    for kind, layout in (("vmem", "per-layer"), ("paged", "per-layer")):
        assert run_one(kind, layout, 6, hybrid, 32, aware=True) == \
            run_one(kind, layout, 6, hybrid, 32, aware=False)
