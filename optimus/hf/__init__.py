"""Hugging Face interop: export a committed checkpoint as a Transformers model folder, and start
a run from one (`model.init_from: "hf:DIR"`).

It reads and writes Optimus checkpoints, so it imports `optimus.checkpoint`; the checkpoint
package never imports it. Its names load on first use (optimus/lazy.py): export and import load
torch, and `optimus checkpoint export` should load it only when it runs.

- `families.py`: which Transformers family a model is, and that family's `config.json`.
- `tensors.py`: Optimus tensor names and layouts <-> the family's.
- `tokenizer.py`: the tokenizer files an export carries.
- `export.py`: `export_hf`, one tensor at a time, from a checkpoint of any layout.
- `load.py`: `load_hf` and the trainer's `init_from`, into a model of any layout.
"""

from optimus.lazy import lazy_names

_WHERE = {
    "Family": "families", "check_hf_config": "families", "choose_family": "families",
    "hf_config": "families", "tokenizer_files": "tokenizer", "export_hf": "export",
    "init_from": "load", "load_hf": "load",
}
__all__ = sorted(_WHERE)
__getattr__ = lazy_names(__name__, _WHERE)
