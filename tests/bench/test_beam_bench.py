"""benchmarks/beam.py on 2 MiB pages at a toy size: tiny-llama's page group holds thousands of
tokens, so a short beam never leaves its first group and every fork's first write copies it:
nothing is shared, each beam holds a private group, and every copy-on-write copies the
member pages its source has mapped (read where the cache binds the plan)."""
from vmemkv.benchmarks import beam
from vmemkv.runtime.models import build_model
from vmemkv.scheduler.cliargs import parse_bytes
from vmemkv.scheduler.plan import CopyExtent

MiB = 2**20


def test_page_bytes_flag_runs_both_layouts_at_each_size_and_names_them():
    sizes = [parse_bytes(s) for s in ("16KiB", "2MiB")]
    assert [(k, o.get("layout"), o.get("page_bytes"), o.get("block_size"))
            for k, o in beam.caches(sizes, (16,))] == [
        ("vmem", "per-layer", 16384, None), ("vmem", "interleaved", 16384, None),
        ("vmem", "per-layer", 2 * MiB, None), ("vmem", "interleaved", 2 * MiB, None),
        ("paged", None, None, 16)]
    assert beam.caches() == beam.CACHES          # no --page-bytes: the docs' table
    assert (beam.size_name(4096), beam.size_name(2 * MiB)) == ("4 KiB", "2 MiB")


def test_bound_copy_bytes_counts_pages_and_token_bytes():
    page = CopyExtent(0, 0, 1, 0, "full")
    tokens = CopyExtent(0, 0, 1, 0, "full", num_tokens=3)
    bound = [(page, {0: [(5, 1), (6, 2)], 1: [(7, 3), (8, 4)]}),
             (tokens, {0: (0, 0, 300), 1: (0, 0, 300)}), ("map", {0: [(1, 2)]})]
    assert beam.bound_copy_bytes(bound, 4096) == 4 * 4096 + 600


def test_two_mib_pages_share_nothing_on_short_beams_and_copy_whole_member_pages():
    model = build_model("tiny-llama")
    prompt, width, new = [list(range(3, 23))], 2, 4        # 20 + 4 tokens: one group
    for layout, members, group in (("per-layer", 4, 16384), ("interleaved", 2, 8192)):
        options = dict(cache="vmem", layout=layout, page_bytes=2 * MiB)
        assert beam.geometry(model, options).tokens_per_page == group
        assert beam.cache_bytes_for(model, options, width, 24) == (width + 1) * members * 2 * MiB
        r = beam.run_one(model, prompt, width, new, options)
        assert r["group_tokens"] == group and r["preemptions"] == 0
        assert r["shared_units"] == r["private_units"]            # 0% saved
        assert r["peak_private_units"] == width * members         # a page per member a beam
        assert r["copies"] > 0 and r["cow_bytes_per_step"] * r["plans"] == \
            r["copies"] * members * 2 * MiB
    paged = beam.run_one(model, prompt, width, new, dict(cache="paged", block_size=16))
    assert paged["shared_units"] < paged["private_units"]          # the full prompt block
