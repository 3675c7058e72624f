"""docs/simulation.md's standard workload gives its log-normals' parameters exactly: followed
as written, the recipe draws the lengths ``generate`` draws (the text said 1.645 for z, which
changed about 100 prompt and 100 output lengths of the 2,000)."""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from vmemkv.scheduler.workload import Z95, WorkloadSpec, generate

DOC = Path(__file__).parents[2] / "docs" / "simulation.md"


def _documented_parameters():
    """z, then prompts' mu and sigma, then outputs' sigma and mu, as the section writes them."""
    section = DOC.read_text().split("## The standard workload", 1)[1].split("\n## ", 1)[0]
    found = [float(x) for x in re.findall(r"\d\.\d{12,}", section)]
    assert len(found) == 5, f"the section gives z, mu and sigma in full: found {found}"
    return found


def test_the_documented_parameters_follow_from_the_documented_formulas():
    z, p_mu, p_sigma, o_sigma, o_mu = _documented_parameters()
    assert z == Z95
    assert p_mu == math.log(584) and p_sigma == (math.log(2155) - p_mu) / z
    d = math.log(1118) - math.log(374)
    assert o_sigma == z - math.sqrt(z * z - 2 * d) and o_mu == math.log(374) - o_sigma ** 2 / 2


def test_the_documented_recipe_draws_the_standard_workload():
    _, p_mu, p_sigma, o_sigma, o_mu = _documented_parameters()
    rng = np.random.default_rng(0)
    prompts = np.maximum(1, np.rint(rng.lognormal(p_mu, p_sigma, 2000))).astype(int)
    outputs = np.maximum(1, np.rint(rng.lognormal(o_mu, o_sigma, 2000))).astype(int)
    unscaled = prompts + outputs <= 4096
    entries = generate(WorkloadSpec())
    assert int((~unscaled).sum()) == 21                       # the doc's "21 requests scaled"
    got = np.array([(e.prompt_len, e.output_len) for e in entries])
    assert (got[unscaled] == np.stack([prompts, outputs], 1)[unscaled]).all()
