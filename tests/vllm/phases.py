"""Engine phases in their own processes, for tests whose proof is "the tokens equal recompute's".

Why a process each: engines built one after another in one process get the same cache memory
back, so a block a load never wrote can still hold what the previous engine computed there, and
tokens would come out equal without any load. Each phase here is a fresh process; `drop` runs
the same hits with some loads left out (the negative control that shows the tokens depend on
what tutti loads)."""

from __future__ import annotations

import json
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent

SCRIPT = r"""
import json, sys
sys.path.insert(0, {here!r})
import harness
args = json.loads(sys.argv[1])
kvt = None
if args.get("kvt"):  # a whole kv_transfer_config of the test's own (tiers, say)
    kvt = args["kvt"]
elif args["connector"]:
    kvt = harness.kv_config(args["root"], chunk=args["chunk"], capacity="64MiB")
    kvt["kv_connector"] = args["connector"]
if args["drop"]:  # the negative control: these loads leave their blocks alone
    from tutti.engine.sched import planner as P
    orig = P.Planner._chunk_blocks
    drop = args["drop"]
    def blocks(self, r, c, state=False):
        out = orig(self, r, c, state)
        return tuple(0 for _ in out) if (drop == "state") == state else out
    P.Planner._chunk_blocks = blocks
llm = harness.make_llm(args["model"], kv_transfer_config=kvt, **args["engine"])
groups = [type(g.kv_cache_spec).__name__ + ":" + str(getattr(g.kv_cache_spec, "mamba_cache_mode", "") or "")
          for g in harness.scheduler(llm).kv_cache_config.kv_cache_groups]
outs = harness.generate_ids(llm, args["prompts"], args["tokens"])
stats = {{}}
if kvt is not None:
    harness.settle(llm)
    stats = dict(vars(harness.connector(llm).planner.stats))
print("RESULT " + json.dumps({{"tokens": [list(o.outputs[0].token_ids) for o in outs],
                              "cached": [o.num_cached_tokens for o in outs], "stats": stats, "groups": groups}}),
      flush=True)
harness.shutdown_llm(llm)
"""


def run(model: Path, root: Path, prompts: list[list[int]], *, connector: str | None, chunk: int,
        engine: dict, drop: str | None = None, tokens: int = 6, kvt: dict | None = None) -> dict:
    """One engine in a fresh process: its tokens, cached tokens, planner stats and KV cache groups;
    {"error": ...} when it did not start or run. `drop`: "kv" or "state" loads left out. `kvt`: a
    kv_transfer_config to use instead of the one over `root`."""
    args = {"model": str(model), "root": str(root), "prompts": prompts, "connector": connector, "chunk": chunk,
            "engine": engine, "drop": drop, "tokens": tokens, "kvt": kvt}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")]))
    import zygote

    # a fork of a process that imported vLLM (zygote.py), or a new interpreter with `env`
    p = zygote.run(SCRIPT.format(here=str(HERE)), [json.dumps(args)], cwd=os.getcwd(), timeout=600, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        return {"error": (p.stderr or p.stdout)[-4000:]}
    return json.loads(lines[-1][7:])


def scale_mixers(path: Path, factor: float, names: tuple[str, ...]) -> None:
    """Scale the named projections of a saved checkpoint, so a tiny random model's tokens depend
    on what its attention and state layers carry (at initialization they barely move the logits)."""
    from safetensors.torch import load_file, save_file

    w = load_file(path)
    for k in w:
        if k.endswith(names):
            w[k] = w[k] * factor
    save_file(w, path, metadata={"format": "pt"})
