"""The pure parts of a Slurm job's rank placement (issue 32 §5, ``sched/slurm/placement.py``): the placement step
computing from the probe's rank files, the file written atomically and read back (a clear refusal without it), each
node launcher's environment from it, the batch script's steps. The real probe and launchers on a real Slurm cluster:
``tests/test_slurm_placement.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kuangchao_core.config import load_config
from kuangchao_core.errors import WorkerFailed
from kuangchao_core.sched.rank_placement import ENV_NODE_OF_RANK, ENV_RANK_MAP
from kuangchao_core.sched.slurm import placement, script

ORDER = [("n1", "10.0.0.11"), ("n2", "10.0.0.12"), ("n3", "10.0.0.13")]
FAST, SLOW = 1e9, 1e7  # bytes/s
TINY = str(Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml")


def _cfg(nodes=3, tasks=1, pp=3, dp=1, **cluster):
    sets = [
        "cluster.mode=slurm",
        f"cluster.slurm.nodes={nodes}",
        f"cluster.slurm.tasks_per_node={tasks}",
        "cluster.nproc_per_node=null",
        f"parallel.data_parallel_size={dp}",
        f"parallel.pipeline_parallel_size={pp}",
        "model.num_layers=3",
    ]
    return load_config(TINY, sets + [f"cluster.{k}={v}" for k, v in cluster.items()])


def _share(run_dir: Path, probe: bool = True) -> dict:
    spec = placement.request(_cfg(), {"pp": 1000.0, "tp": 0.0, "dp": 0.0}, 29601)
    assert spec["probe"] is True
    return {"run_dir": str(run_dir), "attempt": 0, "nproc": 1, "placement": {**spec, "probe": probe}}


def _probe_files(run_dir: Path, slow: str) -> None:
    """The three ranks' files as ``probe_worker`` writes them: every link of ``slow`` at SLOW, the others FAST."""
    out = placement.probe_dir(run_dir, 0) / "ranks"
    out.mkdir(parents=True)
    names = [n for n, _ in ORDER]
    for i, name in enumerate(names):
        row = {j: (SLOW if slow in (name, names[j]) else FAST) for j in range(i + 1, 3)}
        doc = {
            "rank": i,
            "node": name,
            "hostname": name,
            "backend": "gloo",
            "allreduce_small_s": 1e-4,
            "allreduce_large_s": 1e-2,
            "large_bytes": 1 << 20,
            "row_latency_s": {str(j): 1e-4 for j in row},
            "row_bandwidth_Bps": {str(j): bw for j, bw in row.items()},
            "flops_per_s": 1e9,
        }
        (out / f"rank_{i}.json").write_text(json.dumps(doc))


@pytest.mark.parametrize(("slow", "want"), [("n2", [0, 2, 1]), ("n3", [0, 1, 2])])
def test_the_placement_step_chains_pipeline_neighbours_over_the_measured_fast_links(tmp_path, slow, want):
    """n2 slow: stage 1 goes to n3 (n1–n3 is the fast link); n3 slow: Slurm's order is already the best chain —
    the same code, other measurements, another answer."""
    _probe_files(tmp_path, slow)
    record = placement.compute(_share(tmp_path), ORDER, "42")
    assert record["measured"] is True and record["warning"] is None
    assert record["placement"]["rank_of_slot"] == want
    assert [n["ranks"] for n in record["nodes"]] == [[w] for w in want]
    assert record["topology"]["nodes"] == ["n1", "n2", "n3"]
    line = placement.describe(record)
    assert line.startswith("placement of attempt 0 (topology, measured links): n1 (10.0.0.11): ranks [0]; ")


def test_a_failed_probe_places_without_measured_links_and_says_so(tmp_path):
    _probe_files(tmp_path, "n2")
    (placement.probe_dir(tmp_path, 0) / "ranks" / "rank_2.json").unlink()  # one rank never wrote its file
    record = placement.compute(_share(tmp_path), ORDER)
    assert record["measured"] is False and record["topology"] is None
    assert "node probe failed (node probe: 2 of 3 ranks wrote their measurements" in record["warning"]
    assert record["placement"]["rank_of_slot"] == [0, 1, 2], "Slurm's (rendezvous) order, ranks by traffic"
    assert "(topology, probe failed): n1" in placement.describe(record)
    unprobed = placement.compute(_share(tmp_path, probe=False), ORDER)  # a job that did not probe: no warning
    assert unprobed["warning"] is None and unprobed["placement"]["rank_of_slot"] == [0, 1, 2]
    assert "(topology, links not probed): n1" in placement.describe(unprobed)


def test_the_file_is_written_whole_and_each_launcher_takes_its_slots_from_it(tmp_path):
    _probe_files(tmp_path, "n2")
    path = placement.write_placement(placement.placement_path(tmp_path, 0), placement.compute(_share(tmp_path), ORDER))
    assert [p.name for p in path.parent.glob("*placement*")] == ["placement.json"], "no temporary file left"
    record = placement.read_placement(path)
    env = placement.node_env(record, "n2", 1)
    assert json.loads(env[ENV_RANK_MAP]) == [0, 2, 1] and json.loads(env[ENV_NODE_OF_RANK]) == [0, 2, 1]
    with pytest.raises(WorkerFailed, match=r"placement puts nodes \['n1', 'n2', 'n3'\].*node n3 is at position 1"):
        placement.node_env(record, "n3", 1)  # the rendezvous order and the file disagree: refused, not guessed
    identity = {**record, "placement": {**record["placement"], "rank_of_slot": [0, 1, 2]}}
    assert ENV_RANK_MAP not in placement.node_env(identity, "n1", 0), "Slurm's order needs no rank map"


def test_a_missing_or_torn_placement_file_is_refused_naming_shared_storage(tmp_path):
    with pytest.raises(WorkerFailed, match="no placement file .*must be on storage every node shares"):
        placement.read_placement(tmp_path / "placement.json")
    (tmp_path / "placement.json").write_text('{"placement": {"nodes": ["n1"]')
    with pytest.raises(WorkerFailed, match="is unreadable"):
        placement.read_placement(tmp_path / "placement.json")


def test_the_probe_runs_where_measured_links_can_change_the_placement():
    assert placement.wants_probe(_cfg())
    assert not placement.wants_probe(_cfg(placement="blind")), "blind placement reads no links"
    two = _cfg(nodes=2, pp=1, dp=2)
    assert not placement.wants_probe(two), "two nodes make one chain whatever the link"
    assert placement.wants_probe(_cfg(nodes=2, pp=1, dp=2, **{"slurm.gpus_per_node": 2})), "GPU links order the slots"


def test_the_batch_script_probes_then_places_then_trains(tmp_path):
    cfg = _cfg()
    spec = placement.request(cfg, {"pp": 1000.0}, 29601)
    text = script.render_script(cfg, tmp_path, 0, ["--config", "c.yaml"], 29500, python="py", placement=spec)
    probe, place, train = (
        text.index(s) for s in ("--probe --", "kuangchao_core.sched.slurm.placement", "engine.worker")
    )
    assert probe < place < train
    assert '--rdzv_id="$SLURM_JOB_ID-0-probe"' in text and '--rdzv_endpoint="$head_addr:29601"' in text
    assert '|| echo "kuangchao: warning: the node probe failed' in text, "a failed probe does not stop the job"
    unprobed = script.render_script(
        cfg, tmp_path, 0, ["--config", "c.yaml"], 29500, python="py", placement={**spec, "probe": False}
    )
    assert "--probe" not in unprobed and "kuangchao_core.sched.slurm.placement" in unprobed
    assert "slurm.placement" not in script.render_script(cfg, tmp_path, 0, ["--config", "c.yaml"], 29500, python="py")


def test_the_orchestrator_says_the_placement_then_writes_each_nodes_tokens_for_the_ranks_it_hosts(tmp_path):
    """``job._take_placement``: nothing before the file exists; then the line in ``states.log``, the record handed
    to ``on_placement`` (which re-issues the tokens for it) before any node's token file, each for its mesh ranks."""
    from kuangchao_core.sched.slurm import job

    out = script.slurm_dir(tmp_path, 0)
    out.mkdir(parents=True)
    said, calls = [], []
    follow = job._Follow("42", {}, out, said.append)
    take = lambda: job._take_placement(  # noqa: E731
        tmp_path, 0, follow, lambda node, ranks: calls.append((node, ranks)), lambda rec: calls.append("placed")
    )
    assert take() is None and calls == [] and said == []
    _probe_files(tmp_path, "n2")
    placement.write_placement(placement.placement_path(tmp_path, 0), placement.compute(_share(tmp_path), ORDER))
    assert take()["placement"]["rank_of_slot"] == [0, 2, 1]
    assert calls == ["placed", ("n1", [0]), ("n2", [2]), ("n3", [1])]
    assert said == [placement.describe(json.loads(placement.placement_path(tmp_path, 0).read_text()))]
    assert said[0] in (out / "states.log").read_text()


def test_a_job_that_ended_before_placing_its_ranks_is_explained_by_its_own_last_words(tmp_path):
    from kuangchao_core.sched.slurm import job

    assert job._said(tmp_path) == f"no output in {tmp_path}"
    (tmp_path / "batch-7.out").write_text(
        "kuangchao: job 7 attempt 0 on n[1-3], rendezvous on n1 (10.0.0.11)\nTraceback ...\n"
        "kuangchao: placement failed: FileNotFoundError: share.json\n"
    )
    assert job._said(tmp_path) == "kuangchao: placement failed: FileNotFoundError: share.json"
