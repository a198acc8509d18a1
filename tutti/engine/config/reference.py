"""docs/configuration.md, rendered from the table of keys (spec.py) and EngineConfig's defaults:
`python3 -m tutti.engine.config.reference > docs/configuration.md` (a test fails when they differ)."""

from __future__ import annotations

import json
from dataclasses import MISSING, fields

from tutti.engine.config.settings import EngineConfig
from tutti.engine.config.spec import GROUPS, KEYS


def _default(name: str) -> str:
    key = KEYS[name]
    if key.required:
        return "required"
    f = {f.name: f for f in fields(EngineConfig)}[name]
    v = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
    return f"`{json.dumps(v)}`"


def render_reference() -> str:
    """docs/configuration.md: every key, grouped, from the table above."""
    out = ["# Configuration reference", "",
           "Every key tutti takes in the `kv_connector_extra_config` of vLLM's `--kv-transfer-config` (with "
           "`vllm serve`, `tutti serve` or `LLM(kv_transfer_config=...)`). "
           "Rendered from `tutti/engine/config/spec.py` by `python3 -m tutti.engine.config.reference > "
           "docs/configuration.md`; a test fails when the two differ. A bad value stops the server before the "
           "model loads, with a message naming the key, the value and what is expected.", "",
           "The two keys everyone sets:", "",
           "```json", json.dumps({"root": "/mnt/nvme/tutti", "capacity_bytes": "512GiB"}), "```", ""]
    for g, title in GROUPS.items():
        out += [f"## {title}", "", "| key | takes | default | example | what it does |", "|---|---|---|---|---|"]
        for k in KEYS.values():
            if k.group == g:
                out.append(f"| `{k.name}` | {k.takes} | {_default(k.name)} | `{json.dumps(k.example)}` | {k.doc} |")
                if k.name == "root":
                    out.append("| `roots` | a list of directory paths | - | `[\"/mnt/nvme0/tutti\", "
                               "\"/mnt/nvme1/tutti\"]` | `root` striped over several directories, one per drive. |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render_reference(), end="")
