"""Run by tests/distributed/test_tensor_parallel.py under torchrun: rank 0 builds the engine
with ``tp_launch="env"`` and writes its greedy tokens to argv[1]; ranks 1..N-1 follow. Each rank
then ends with ``os._exit``, as a spawned rank does (worker.spawned_rank_main): the engine is
closed, the group left and the file written by then, and the interpreter's teardown with torch
and transformers loaded cost about 0.9 s of CPU a rank, which torchrun and the test waited for."""
import json
import os
import sys

from vmemkv.runtime.distributed import follow
from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.models import build_model


def main() -> None:
    world = int(os.environ["WORLD_SIZE"])
    model = build_model("tiny-llama", seed=0)
    if int(os.environ["RANK"]) != 0:
        follow(model)
        return
    with Engine(model, max_batch=2, max_context=128, tensor_parallel_size=world,
                tp_launch="env") as engine:
        out = engine.generate([[1, 2, 3, 4], [9, 8, 7]], SamplingParams(max_new_tokens=8))
    with open(sys.argv[1], "w") as f:
        json.dump([o.outputs[0].token_ids for o in out], f)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
