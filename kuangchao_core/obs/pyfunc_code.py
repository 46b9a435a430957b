"""The MLflow "models from code" file of an exported Kuangchao model: copied into the model directory as
``kc_pyfunc.py``, so ``mlflow.pyfunc.load_model(...)`` answers prompts greedily with no Kuangchao installed.

It imports only torch, ``transformers`` (``LlamaForCausalLM`` from the directory's ``config.json`` and
``model.safetensors``, local files only — never a hub) and ``tokenizers`` (the directory's ``tokenizer.json``); no
weight is pickled. The model directory is the pyfunc artifact ``weights`` (its path is ``.``: the Hugging Face files
sit at the root of the MLflow model, beside ``MLmodel``).

``predict(["12+34="])`` returns one completion per prompt, without the end token: tokens are chosen greedily until
the tokenizer's end token (``tokenizer_config.json``'s ``eos_token``, else a known end-of-text token, else the
newline — the rule of ``kuangchao_core.data.tokenizer``) or ``max_new_tokens`` (model config, default 32).
"""

from __future__ import annotations

import json
from pathlib import Path

from mlflow.models import set_model
from mlflow.pyfunc import PythonModel

_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")
DEFAULT_MAX_NEW_TOKENS = 32


def _stop_id(root: Path, tok) -> int:
    """The end token's id, chosen as ``kuangchao_core.data.tokenizer.HFTokenizer`` chooses its separator."""
    config_path = root / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    eos = config.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    vocab = tok.get_vocab(with_added_tokens=True)
    if isinstance(eos, str) and eos in vocab:
        return int(vocab[eos])
    for name in _EOS_NAMES:
        if name in vocab:
            return int(vocab[name])
    return int(tok.encode("\n", add_special_tokens=False).ids[0])


class KuangchaoGreedy(PythonModel):
    """A causal LM exported by Kuangchao, answering each prompt greedily (see the module docstring)."""

    def load_context(self, context) -> None:
        """Load the weights and tokenizer from the ``weights`` artifact (the model directory)."""
        import torch
        from tokenizers import Tokenizer
        from transformers import AutoModelForCausalLM

        root = Path(context.artifacts["weights"]).resolve()
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(root), local_files_only=True, use_safetensors=True)
        self.model.eval()
        self.tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        self.stop = _stop_id(root, self.tok)
        config = context.model_config or {}
        self.max_new = int(config.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))

    def predict(self, context, model_input: list[str], params=None) -> list[str]:
        """One greedy completion per prompt, ending before the end token."""
        torch = self.torch
        answers = []
        with torch.no_grad():
            for prompt in model_input:
                ids = self.tok.encode(str(prompt), add_special_tokens=False).ids
                out: list[int] = []
                x = torch.tensor([ids], dtype=torch.long)
                for _ in range(self.max_new):
                    nxt = int(self.model(input_ids=x).logits[0, -1].argmax())
                    if nxt == self.stop:
                        break
                    out.append(nxt)
                    x = torch.cat([x, torch.tensor([[nxt]], dtype=torch.long)], dim=1)
                answers.append(self.tok.decode(out, skip_special_tokens=False))
        return answers


set_model(KuangchaoGreedy())  # the model MLflow's loader takes from this file
