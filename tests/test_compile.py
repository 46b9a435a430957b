"""``train.compile``: decoder layers compiled in place, names unchanged, the same numbers as eager.

The bare-model check uses the ``aot_eager`` backend (dynamo's capture and AOTAutograd's forward/backward split,
without code generation). The engine check trains 6 steps at dp2 and at tp2 with the job's real compiler, inductor
(C++ kernels built with gcc on a CPU), and compares every step's loss with the same job run eagerly.

Tolerance. Compiled and eager runs compute the same fp32 operations; inductor changes only how they round:

- it fuses pointwise chains (norm scaling, rotary, SiLU·up, residual adds) into one loop, keeping intermediates in
  fp32 registers: in an fp32 job every intermediate is fp32 either way, so a fused chain rounds the same values,
  at most reassociating a multiply-add (one rounding, ``u = 2**-24``, instead of two);
- it reassociates reductions (RMSNorm's mean over hidden 64, softmax sums over ≤ 32 keys, gradient sums over the
  batch of 4×32 tokens): for ``n`` terms that moves the result by ≲ ``sqrt(n)·u`` relative, the same bound
  :mod:`tests.tolerances` derives for a CPU blocking a reduction differently;
- its vectorised transcendentals (exp, rsqrt, sigmoid) are within 1 ulp, as ATen's own vectorised ones are: ≲ 2u
  per element between the two.

Matrix products stay library calls (``extern_calls``) in both. So each step differs from eager by the rounding-level
amounts ``FP32_LOSS_REL`` was derived for (≈ 1e-6 per token's log-softmax over 256, AdamW's amplification of
rounding-level gradients second order in the loss), and the fp32 bound applies unchanged: ``FP32_LOSS_REL = 1e-5``.
The negative control shows the comparison resolves a 0.1 % change of the learning rate.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from kuangchao_core.config.settings import run_settings
from kuangchao_core.config.unused import unused_settings
from kuangchao_core.engine.parallel_model import build_parallel_model
from kuangchao_core.models.compile import compile_layers
from kuangchao_core.models.llama import LlamaForCausalLM, causal_lm_loss, config_from_model_section
from tests.engine_helpers import tiny_job
from tests.tolerances import FP32_GRAD_REL, FP32_LOSS_REL, max_rel_diff, rel_norm


def _mesh():
    return SimpleNamespace(tp=1, pp=1, tp_rank=0, pp_rank=0, rank=0, tp_group=None, pp_group=None)


def test_compile_setting_compiles_each_layer_of_the_engine_model(tmp_path):
    cfg = tiny_job(str(tmp_path), train={"compile": True})
    parts = build_parallel_model(
        run_settings(cfg).build, config_from_model_section(cfg.model), _mesh(), torch.device("cpu")
    )
    layers = list(parts.model.model.layers)
    assert layers and all(layer._compiled_call_impl is not None for layer in layers)
    assert parts.model.model.embed_tokens._compiled_call_impl is None  # only the blocks
    plain = tiny_job(str(tmp_path / "plain"))
    eager = build_parallel_model(
        run_settings(plain).build, config_from_model_section(plain.model), _mesh(), torch.device("cpu")
    )
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
    pp = tiny_job(str(tmp_path), parallel={"pipeline_parallel_size": 2, "zero_stage": 3})  # ZeRO-3 runs under pp
    assert not any(path == "parallel.zero_stage" for path, _ in unused_settings(pp))


def test_only_the_submodules_that_communicate_run_eagerly_under_tensor_parallelism():
    from kuangchao_core.models.compile import keep_collectives_eager
    from kuangchao_core.models.tp_llama import TPLlamaForCausalLM

    cfg = config_from_model_section(tiny_job("/tmp/unused").model)
    tp = TPLlamaForCausalLM(cfg, SimpleNamespace(size=2, rank=0))  # building needs the group's size and rank only
    marked = [keep_collectives_eager(layer) for layer in tp.model.layers]
    eager = {
        n.split(".", 3)[-1] for n, m in tp.model.layers.named_modules(prefix="model.layers") if "forward" in vars(m)
    }
    # the two norms (backward all-reduce) and the two row-parallel projections (forward all-reduce); q/k/v and
    # gate/up share the norm's copy-in and do not communicate themselves, so they stay in the compiled graph
    assert marked == [4, 4]
    assert eager == {"input_layernorm", "post_attention_layernorm", "self_attn.o_proj", "mlp.down_proj"}
    plain = LlamaForCausalLM(cfg)
    assert [keep_collectives_eager(layer) for layer in plain.model.layers] == [0, 0]  # nothing to keep out


# ------------------------------------------------------------------ the engine compiled with inductor, dp2 and tp2
STEPS = 6
JOBS = {  # name: (parallel section, compiled, learning-rate factor)
    "dp2_eager": ({"data_parallel_size": 2}, False, 1.0),
    "dp2_compiled": ({"data_parallel_size": 2}, True, 1.0),
    "dp2_compiled_lr+0.1%": ({"data_parallel_size": 2}, True, 1.001),  # negative control
    "tp2_eager": ({"tensor_parallel_size": 2}, False, 1.0),
    "tp2_compiled": ({"tensor_parallel_size": 2}, True, 1.0),
}


class _Lines(logging.Handler):
    def __init__(self, lines: list) -> None:
        super().__init__()
        self.lines = lines

    def emit(self, record) -> None:
        self.lines.append((record.getMessage(), dict(getattr(record, "fields", {}) or {})))


def _compiled_comm_frames() -> list[str]:
    """The functions of the communication layer dynamo holds compiled code for (should be none)."""
    import inspect

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from kuangchao_core.comm import dispatch, primitives

    found = []
    for module in (primitives, dispatch):
        for name, fn in vars(module).items():
            if inspect.isfunction(fn) and fn.__module__ == module.__name__ and _debug_get_cache_entry_list(fn.__code__):
                found.append(f"{module.__name__}.{name}")
    return found


def _train_jobs(rank: int, world_size: int, jobs: list):
    import torch._dynamo

    from kuangchao_core.models.compile import CLOCK
    from tests.engine_helpers import trainer_in_process

    lines: list = []
    logger = logging.getLogger("kuangchao.models.compile")
    logger.addHandler(_Lines(lines))
    logger.setLevel(logging.INFO)
    counters = torch._dynamo.utils.counters
    out: dict = {}
    trainer = None
    for name, cfg in jobs:
        counters.clear()
        compilations = CLOCK.compilations
        trainer = trainer_in_process(cfg, rank, world_size)
        state = trainer.run(resume="never")
        out[name] = {
            "losses": list(state.losses),
            "graphs": counters["stats"]["unique_graphs"],
            "inductor_graphs": counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"],
            "compilations": CLOCK.compilations - compilations,
            "comm_frames": _compiled_comm_frames(),
        }
    # control of the probe above: a row-parallel layer compiled as a whole has dynamo compile the all-reduce's frames
    from kuangchao_core.parallel.tensor import RowParallelLinear

    row = RowParallelLinear(8, 4, trainer.mesh.tp_group, seed=1)
    torch.compile(row, backend="eager")(torch.randn(2, 4))
    out["probe_control"] = _compiled_comm_frames()
    out["log"] = lines
    return out


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    from tests.mp import run_distributed

    tmp = tmp_path_factory.mktemp("compile")
    jobs = []
    for name, (par, compiled, lr_factor) in JOBS.items():
        cfg = tiny_job(
            str(tmp / name),
            parallel=par,
            train={"steps": STEPS, "compile": compiled},
            optimizer={"lr": 3e-3 * lr_factor, "weight_decay": 0.01},
        )
        jobs.append((name, cfg))
    return run_distributed(_train_jobs, 2, args=(jobs,), timeout=280)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_inductor_compiled_engine_steps_give_the_eager_losses(engine_runs, layout):
    for rank_out in engine_runs:
        eager, compiled = rank_out[f"{layout}_eager"], rank_out[f"{layout}_compiled"]
        assert len(compiled["losses"]) == STEPS and all(0 < x < 10 for x in compiled["losses"])
        assert max_rel_diff(compiled["losses"], eager["losses"]) <= FP32_LOSS_REL, (compiled, eager)
        # inductor really built the layers' code: dynamo captured graphs, inductor produced (or loaded from its
        # cache) a forward and a backward graph, and the eager job compiled nothing
        assert compiled["graphs"] >= 1 and compiled["inductor_graphs"] >= 2 and compiled["compilations"] >= 1
        assert eager["graphs"] == 0 and eager["compilations"] == 0
        # the collectives ran outside dynamo: it compiled no frame of the communication layer
        assert compiled["comm_frames"] == []


@pytest.mark.slow
def test_the_loss_comparison_sees_a_learning_rate_changed_by_a_thousandth(engine_runs):
    for rank_out in engine_runs:
        perturbed, eager = rank_out["dp2_compiled_lr+0.1%"]["losses"], rank_out["dp2_eager"]["losses"]
        assert perturbed[0] == pytest.approx(eager[0], rel=FP32_LOSS_REL)  # the first step's loss precedes any update
        assert max_rel_diff(perturbed, eager) > FP32_LOSS_REL
    # and the probe of compiled communication frames finds them when a collective is compiled over
    assert any("all_reduce" in f for f in engine_runs[0]["probe_control"]), engine_runs[0]["probe_control"]


@pytest.mark.slow
def test_rank0_logs_the_compile_time_once(engine_runs):
    (message, fields), *more = engine_runs[0]["log"]
    assert more == [], engine_runs[0]["log"]  # one line for the process, though it compiled two jobs' layers
    assert message.startswith("compiled 2 decoder layers with inductor in ") and message.endswith(" s")
    assert fields["layers"] == 2 and fields["backend"] == "inductor"
    assert 0 < fields["compile_s"] < 280 and fields["compilations"] >= 1
    assert engine_runs[1]["log"] == []  # other ranks stay quiet
