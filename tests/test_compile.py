"""``train.compile``: decoder layers compiled in place, names unchanged, the same numbers as eager.

The job's compiler is inductor, which needs tens of seconds on a CPU for the first step; the numbers are checked
with the ``aot_eager`` backend (dynamo's capture and AOTAutograd's forward/backward split, without code generation),
the configuration path by what the engine builds.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kuangchao_core.config.unused import unused_settings
from kuangchao_core.engine.parallel_model import build_parallel_model
from kuangchao_core.models.compile import compile_layers
from kuangchao_core.models.llama import LlamaForCausalLM, causal_lm_loss, config_from_model_section
from tests.engine_helpers import tiny_job
from tests.tolerances import FP32_GRAD_REL, FP32_LOSS_REL, rel_norm


def _mesh():
    return SimpleNamespace(tp=1, pp=1, tp_rank=0, pp_rank=0, rank=0, tp_group=None, pp_group=None)


def test_compile_setting_compiles_each_layer_of_the_engine_model(tmp_path):
    cfg = tiny_job(str(tmp_path), train={"compile": True})
    parts = build_parallel_model(cfg, config_from_model_section(cfg.model), _mesh(), torch.device("cpu"))
    layers = list(parts.model.model.layers)
    assert layers and all(layer._compiled_call_impl is not None for layer in layers)
    assert parts.model.model.embed_tokens._compiled_call_impl is None  # only the blocks
    plain = tiny_job(str(tmp_path / "plain"))
    eager = build_parallel_model(plain, config_from_model_section(plain.model), _mesh(), torch.device("cpu"))
    assert all(layer._compiled_call_impl is None for layer in eager.model.model.layers)
    assert [n for n, _ in parts.model.named_parameters()] == [n for n, _ in eager.model.named_parameters()]


def test_compiled_layers_give_the_eager_loss_and_gradients():
    import torch._dynamo

    cfg = config_from_model_section(tiny_job("/tmp/unused").model)
    eager, compiled = LlamaForCausalLM(cfg), LlamaForCausalLM(cfg)
    eager.init_weights(5)
    compiled.init_weights(5)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert compile_layers(compiled, backend="aot_eager") == cfg.num_layers
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for model in (eager, compiled):
        loss = causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        losses.append(float(loss.detach()))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # dynamo really captured the layers
    assert abs(losses[1] - losses[0]) <= FP32_LOSS_REL * abs(losses[0])
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert rel_norm(q.grad, p.grad) <= FP32_GRAD_REL, name


def test_compile_under_zero3_is_reported_not_silently_dropped(tmp_path):
    cfg = tiny_job(str(tmp_path), train={"compile": True}, parallel={"data_parallel_size": 2, "zero_stage": 3})
    assert any(path == "train.compile" for path, _ in unused_settings(cfg))
    pp = tiny_job(str(tmp_path), parallel={"pipeline_parallel_size": 2, "zero_stage": 3})
    assert any(path == "parallel.zero_stage" and "ZeRO-2" in why for path, why in unused_settings(pp))
