"""An exported model directory made loadable by MLflow's own loaders (``mlflow.pyfunc.load_model``).

:func:`write_pyfunc_files` adds, beside the Hugging Face files of an exported model (``hf`` format), an ``MLmodel``
with the ``python_function`` flavour in MLflow's "models from code" form: the code file
:mod:`kuangchao_core.obs.pyfunc_code` copied as ``kc_pyfunc.py``, whose ``KuangchaoGreedy`` loads ``config.json`` +
``model.safetensors`` with ``transformers`` and ``tokenizer.json`` with ``tokenizers`` (local files, nothing from a
hub, no pickled weights) and greedily answers a list of prompts. The weights are not copied: the flavour's one
artifact, ``weights``, is the model directory itself (path ``.``). ``export.json``'s ``files`` then names the added
files too, so the logged ``model`` artifacts and the record still agree.

A ``peft`` export (LoRA adapters) holds no whole model, so it gets no ``MLmodel``: merge it first
(``kc checkpoint convert --format hf``). Nor does a vision-language model (a transformers LLaVA directory, issue 31):
the code answers text prompts with ``LlamaForCausalLM`` and could not load it; its files are logged as they are
(``LlavaForConditionalGeneration.from_pretrained`` loads them).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

#: the code file of the pyfunc model, and the name it has inside the model directory
CODE_FILE = Path(__file__).with_name("pyfunc_code.py")
CODE_NAME = "kc_pyfunc.py"
#: what a loading environment needs (the versions of this one are not pinned: the file uses stable APIs only)
PIP_REQUIREMENTS = ("mlflow", "torch", "transformers", "tokenizers", "safetensors")
EXPORT_RECORD = "export.json"


def _answers_text_prompts(model_dir: Path) -> bool:
    """Whether the exported model is a causal language model the pyfunc code loads (not a LLaVA, say)."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    return config.get("architectures") == ["LlamaForCausalLM"]


def write_pyfunc_files(model_dir: str | Path, record: dict[str, Any], max_new_tokens: int = 32) -> dict[str, Any]:
    """Make ``model_dir`` (an ``hf`` export) an MLflow pyfunc model in place and return ``record`` with its
    ``files`` updated (``export.json`` rewritten); a ``peft`` export or a LLaVA is returned unchanged. ``max_new_tokens``:
    the longest answer ``predict`` generates."""
    import mlflow

    model_dir = Path(model_dir)
    if record.get("format") != "hf" or not _answers_text_prompts(model_dir):
        return record
    with tempfile.TemporaryDirectory(prefix="kc-pyfunc-") as tmp:
        staged = Path(tmp) / "m"
        staged_code = Path(tmp) / CODE_NAME
        shutil.copyfile(CODE_FILE, staged_code)
        mlflow.pyfunc.save_model(
            path=str(staged),
            python_model=str(staged_code),
            model_config={"max_new_tokens": int(max_new_tokens)},
            pip_requirements=list(PIP_REQUIREMENTS),
        )
        model = mlflow.models.Model.load(str(staged))
        model.flavors["python_function"]["artifacts"] = {"weights": {"path": "."}}
        model.save(str(staged / "MLmodel"))
        added = []
        for path in sorted(staged.iterdir()):
            if path.is_file():
                shutil.copyfile(path, model_dir / path.name)
                added.append(path.name)
    files = sorted(set(record.get("files", [])) | set(added))
    record = {**record, "files": files}
    (model_dir / EXPORT_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return record
