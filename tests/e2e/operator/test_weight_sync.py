"""Weight sync end to end: a trainer pod publishes a real model's state dict every step to rollout pods.

Real control plane, the real operator, real workload processes moving bytes with NIXL; the model is a
Qwen2 architecture built by transformers from a config (random initialisation, gpuobj_dev.models).
The pattern (docs/weight-sync.md): one GPUObject per version, a claim per reader, the trainer's own
reference dropped once the next version is out, each reader releasing the previous version once it
holds the new one.
"""

from __future__ import annotations

import pytest

from gpuobj_dev.testing import agent_http
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.operator import OperatorProcess
from gpuobj_dev.testing.waits import wait_until
from gpuobj_kube.client import GPUOBJECTS
from tests.e2e.operator.conftest import Pods, kube
from tests.e2e.operator.test_lifecycle import assert_api_empty, wait_object

pytestmark = pytest.mark.nixl

TRAINER = "trainer"
READERS = ("rollout-0", "rollout-1")
SETUP = "from gpuobj_dev import models; held = {}"


def registrations(pods: Pods, token_file) -> float:
    """The trainer's NIXL registrations on a put's path: all of them (gpuobj_agent_nixl_registrations_total) but
    those made ahead, in a spare agent after a free (docs/weight-sync.md), once none is under way."""
    trainer = pods.workloads[TRAINER]
    found: list[float] = []

    def settled() -> bool:
        """No registration ahead under way before the metric's read and after it: the count made ahead
        (taken when one starts) and the metric (when it ends) agree, or the read is made again."""
        quiet = "client.agent.agent.store.registering_ahead == 0"
        if not trainer.eval(quiet):
            return False
        total = registered()
        ahead, still = trainer.eval(f"[client.agent.agent.nixl.registered_ahead, {quiet}]")
        found[:] = [total - ahead]
        return bool(still) and registered() == total

    def registered() -> float:
        return agent_http.metric(pods.endpoint(TRAINER), "gpuobj_agent_nixl_registrations_total", {"op": "register"})

    wait_until(settled, "the registration ahead", 30)
    return found[0]


def connected_ahead(reader) -> int:
    """A reader's first fetches whose source NIXL agent it had connected to ahead (from an announcement)."""
    return reader.eval("client.agent.agent.fetcher.preconnected_reads")


def publish(trainer, version: int) -> int:
    """One training step, then put the new state dict; the trainer's reference to the previous one goes."""
    trainer.run(
        f"models.step(model, {version}); sd = model.state_dict(); crc = models.checksum(sd)\n"
        f"held[{version}] = client.put(sd, name='policy-v{version}')\n"
        f"old = held.pop({version - 1}, None)\n"
        "if old is not None: client.release(old)"
    )
    return trainer.eval("crc")


def hand_to(trainer, reader, name: str, version: int, crc: int) -> None:
    """The reader adopts its claim on `version`, fetches it, verifies it, then releases the version before."""
    shared = trainer.eval_pickle(f"client.share(held[{version}], {name!r})")
    reader.run(
        f"h = client.adopt(load_pickle({shared!r})); sd = client.fetch(h)\n"
        f"assert models.checksum(sd) == {crc}, 'version {version} is not the one published'\n"
        f"held[{version}] = (h, sd)\n"
        f"old = held.pop({version - 1}, None)\n"
        "if old is not None: client.release(old[0])\n"  # returns once the source took it
        "del old, sd"
    )


def freed(trainer) -> None:
    """The version before last is freed at the source: its pack buffer is back in the trainer's pool."""
    wait_until(lambda: trainer.eval("client.pack_stats()['idle']") >= 1, "the previous version freed", 30)


def finish(cluster, namespace, pods: Pods, token_file, trainer, readers) -> None:
    """Everyone lets go: every version freed, nothing held but the trainer's idle pack buffers."""
    for name, reader in readers.items():
        reader.run("[h.release() for h, _ in held.values()]; held.clear()")
        agent_http.assert_holds_nothing(pods.endpoint(name), token_file)
    trainer.run("[r.release() for r in held.values()]; held.clear(); client.flush()")
    wait_until(lambda: kube(cluster, lambda k: k.list(GPUOBJECTS, namespace))["items"] == [], "every version freed", 30)
    endpoint = pods.endpoint(TRAINER)
    assert agent_http.inventory(endpoint, token_file)["objects"] == []
    assert agent_http.metric(endpoint, "gpuobj_agent_store_bytes") == 0
    assert agent_http.metric(endpoint, "gpuobj_agent_quarantined_bytes") == 0
    pool = trainer.eval("client.pack_stats()")
    assert pool["busyBytes"] == 0
    # Every version here was read, so each free destroyed its version's NIXL agent before the buffer went
    # back to the pool (a replayed grant fails, never reads the next version); each buffer is registered
    # again, ahead of its next version, in a spare agent whose key no reader holds: nothing else is.
    wait_until(
        lambda: agent_http.metric(endpoint, "gpuobj_agent_nixl_registered_bytes") == pool["bytes"],
        "only the idle pack buffers registered (ahead)",
        30,
    )
    assert_api_empty(cluster, namespace)


def test_a_real_models_state_dict_round_trips_with_names_dtypes_bytes_and_tied_weights(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    trainer, reader = pods.workload(TRAINER), pods.workload(READERS[0])
    for w in (trainer, reader):
        w.run(SETUP + "; model = models.build('tiny')")
    before = registrations(pods, token_file)
    trainer.run("sd = model.state_dict(); ref = client.put(sd, name='policy'); client.flush()")
    count = trainer.eval("len(sd)")
    assert count > 20 and registrations(pods, token_file) == before + 1  # every tensor in one region
    obj = kube(gpuobj_cluster, lambda k: k.get(GPUOBJECTS, "policy", namespace))
    assert obj["spec"]["tensors"][0]["name"]  # kubectl shows what each tensor is
    assert trainer.eval("model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()")
    assert len(obj["spec"]["tensors"]) == count - 1  # the tied output layer is stored once

    shared = trainer.eval_pickle("client.share(ref, 'rollout-0')")
    reader.run(f"h = client.adopt(load_pickle({shared!r})); got = client.fetch(h); mine = model.state_dict()")
    assert reader.eval("list(got) == list(mine)")
    assert reader.eval("all(got[n].dtype == t.dtype and got[n].shape == t.shape for n, t in mine.items())")
    assert reader.eval("got['model.embed_tokens.weight'].dtype == torch.bfloat16")
    assert reader.eval("all(torch.equal(got[n], t) for n, t in mine.items())")  # same seed, same weights
    assert reader.eval("got['lm_head.weight'] is got['model.embed_tokens.weight']")  # restored tied
    # The rollout side: load the fetched weights into its model and run it (tied weights stay tied).
    reader.run("model.load_state_dict(got); x = models.fixed_input(model); logits = model(x).logits")
    trainer.run("logits = model(models.fixed_input(model)).logits")
    same = "models.checksum({'logits': logits}, stride=1)"  # every byte
    assert reader.eval(same) == trainer.eval(same)  # bit for bit
    reader.run("del got, mine; h.release()")
    trainer.run("ref.release()")
    wait_object(gpuobj_cluster, namespace, "policy", lambda o: o is None)
    finish(gpuobj_cluster, namespace, pods, token_file, trainer, {READERS[0]: reader})


def test_a_state_dict_of_more_tensors_than_are_listed_is_recorded_by_count_and_bytes(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    """Past LISTED_TENSORS_MAX the GPUObject carries spec.tensorSummary, not every layout; the operator's
    status reads the same bytes and count, and a reader gets every tensor (its layouts come from the agent)."""
    trainer, reader = pods.workload(TRAINER), pods.workload(READERS[0])
    make = "sd = {f'layers.{i}.w': torch.full((4, 3 + i % 5), float(i), dtype=torch.bfloat16) for i in range(300)}"
    trainer.run(f"{make}; ref = client.put(sd, name='many'); client.flush()")
    nbytes = trainer.eval("sum(t.nbytes for t in sd.values())")
    ready = lambda o: o and (o.get("status") or {}).get("state") == "Ready"  # noqa: E731
    obj = wait_object(gpuobj_cluster, namespace, "many", ready)
    assert "tensors" not in obj["spec"] and obj["spec"]["tensorSummary"] == {"count": 300, "bytes": nbytes}
    assert (obj["status"]["bytes"], obj["status"]["tensorCount"]) == (nbytes, 300)
    shared = trainer.eval_pickle("client.share(ref, 'rollout-0')")
    reader.run(f"{make}; h = client.adopt(load_pickle({shared!r})); got = client.fetch(h)")
    assert reader.eval("list(got) == list(sd) and all(torch.equal(got[n], t) for n, t in sd.items())")
    reader.run("del got; h.release()")
    trainer.run("ref.release(); client.flush()")
    wait_object(gpuobj_cluster, namespace, "many", lambda o: o is None)


def test_versions_reuse_their_buffers_with_one_registration_each_and_a_lagging_reader_keeps_its_own(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    trainer = pods.workload(TRAINER)
    readers = {name: pods.workload(name) for name in READERS}
    trainer.run(SETUP + "; model = models.build('tiny')")
    for reader in readers.values():
        reader.run(SETUP)
    crcs = {}
    for version in (1, 2):
        crcs[version] = publish(trainer, version)
        for name, reader in readers.items():
            hand_to(trainer, reader, name, version, crcs[version])
    freed(trainer)
    after_second = registrations(pods, token_file)
    # Readers keep up, and each version is published as soon as they hold the one before, while the
    # operator's free of the version two back may still be on its way: the put waits for that free
    # (every reference to it is released) and reuses its buffer rather than making a new one. That
    # version was read, so its free destroyed the NIXL agent its readers were given, and registered the
    # buffer in the spare agent announced with the version after it: the put registers nothing, and each
    # reader, connected to that spare after its last fetch, makes no new connection (docs/weight-sync.md).
    # (Version 3's spare was still being made when rollout-0 was handed version 2, the spares' first use: it
    # connects on its first fetch of version 3; the agents' spares are ready ahead from then on.)
    connected = {}
    for version in range(3, 7):
        crcs[version] = publish(trainer, version)
        for name, reader in readers.items():
            hand_to(trainer, reader, name, version, crcs[version])
        if version == 3:
            connected = {name: connected_ahead(reader) for name, reader in readers.items()}
    assert registrations(pods, token_file) == after_second  # none on the path of versions 3-6
    assert {name: connected_ahead(reader) - connected[name] for name, reader in readers.items()} == {
        name: 3
        for name in readers  # versions 4-6: every first fetch found its agent connected
    }
    pool = trainer.eval("client.pack_stats()")
    assert (pool["buffers"], pool["waitTimeouts"]) == (2, 0)

    # rollout-1 lags: it keeps version 6 while the trainer publishes 7 and 8 and rollout-0 follows.
    lagging, keeping = readers["rollout-1"], readers["rollout-0"]
    for version in (7, 8):
        crcs[version] = publish(trainer, version)
        hand_to(trainer, keeping, "rollout-0", version, crcs[version])
    assert lagging.eval(f"models.checksum(held[6][1]) == {crcs[6]}")  # its copy is version 6, whole
    # and version 6 still lives at the source, untouched by 7 and 8: a fresh fetch is version 6 again
    assert lagging.eval(f"models.checksum(client.fetch(held[6][0])) == {crcs[6]}")
    trainer.run("client.flush()")  # recorded now (write-behind elides what lives only briefly)
    assert kube(gpuobj_cluster, lambda k: k.get(GPUOBJECTS, "policy-v6", namespace))["status"]["state"]
    assert trainer.eval("client.pack_stats()['buffers']") == 3  # the lag cost one region, no waiting
    finish(gpuobj_cluster, namespace, pods, token_file, trainer, readers)


def test_a_reader_killed_mid_fetch_leaves_nothing_held(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    trainer, reader = pods.workload(TRAINER), pods.workload(READERS[0])
    trainer.run(SETUP + "; model = models.build('small')")
    reader.run("import threading; fetching = threading.Event()")
    incarnation = reader.eval("client.incarnation")
    trainer.run("ref = client.put(model.state_dict(), name='policy-v1')")
    shared = trainer.eval_pickle(f"client.share(ref, 'rollout-0', incarnation={incarnation!r})")
    reader.run(
        f"h = client.adopt(load_pickle({shared!r}))\n"
        "def loop():\n"
        "    while True:\n"
        "        fetching.set(); client.fetch(h)\n"
        "threading.Thread(target=loop, daemon=True).start(); fetching.wait(30)"
    )
    pods.workloads[READERS[0]].kill()  # SIGKILL while it reads (it does little else)
    trainer.run("ref.release(); client.flush()")
    wait_object(gpuobj_cluster, namespace, "policy-v1", lambda o: o is None, timeout=60)
    endpoint = pods.endpoint(TRAINER)
    assert agent_http.inventory(endpoint, token_file)["objects"] == []
    wait_until(lambda: agent_http.metric(endpoint, "gpuobj_agent_inflight_reads") == 0, "no read in flight", 30)
    assert agent_http.metric(endpoint, "gpuobj_agent_store_bytes") == 0
    assert trainer.eval("client.pack_stats()['busyBytes']") == 0
    wait_until(lambda: operator.metric("gpuobj_leaked_bytes") == 0, "no leaked bytes", 30)
    assert_api_empty(gpuobj_cluster, namespace)


def test_tensor_parallel_readers_each_pull_their_half_and_move_half_the_bytes(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    """docs/weight-sync.md, "Sharded pulls": each TP rank fetches its slice of every weight (dim 0 for the
    matrices, whole tensors by names for the rest) as one READ; the two halves are the model, bytes and all."""
    trainer = pods.workload(TRAINER)
    readers = {name: pods.workload(name) for name in READERS}
    for w in (trainer, *readers.values()):
        w.run(SETUP + "; model = models.build('tiny'); import gpuobj")
    trainer.run("ref = client.put(model.state_dict(), name='policy'); client.flush()")
    full = trainer.eval("sum({t.data_ptr(): t.nbytes for t in model.state_dict().values()}.values())")
    moved = 0.0
    for rank, (name, reader) in enumerate(readers.items()):
        shared = trainer.eval_pickle(f"client.share(ref, {name!r})")
        before = agent_http.metric(pods.endpoint(name), "gpuobj_agent_transfer_bytes_total", {"direction": "in"})
        reader.run(
            f"h = client.adopt(load_pickle({shared!r})); mine = model.state_dict()\n"
            "rows = [n for n, t in mine.items() if t.dim() >= 1 and t.shape[0] % 2 == 0]\n"
            f"got = client.fetch(h, select=gpuobj.Shard(names=rows, dim=0, index={rank}, count=2))\n"
            "rest = [n for n in mine if n not in rows]\n"
            f"whole = client.fetch(h, select=gpuobj.Shard(names=rest)) if rest else {{}}"
        )
        moved += (
            agent_http.metric(pods.endpoint(name), "gpuobj_agent_transfer_bytes_total", {"direction": "in"}) - before
        )
        assert reader.eval("sorted(got) == sorted(rows) and len(rows) > 20")
        assert reader.eval(f"all(torch.equal(got[n], torch.chunk(mine[n], 2, 0)[{rank}]) for n in rows)")
        assert reader.eval("all(torch.equal(whole[n], mine[n]) for n in rest)")
        reader.run(  # a bad selection is refused by the client before any read, naming what is wrong
            "try:\n    client.fetch(h, select=gpuobj.Shard(names=['nope'], dim=0, count=2)); err = ''\n"
            "except gpuobj.InvalidRequestError as exc:\n    err = str(exc)"
        )
        assert "no tensor named 'nope'" in reader.eval("err")
        reader.run("del got, whole, mine; h.release()")
    rest_bytes = readers[READERS[0]].eval(
        "sum({t.data_ptr(): t.nbytes for n, t in model.state_dict().items() if n in rest}.values())"
    )
    assert moved == full + rest_bytes  # each rank: half of every sliced tensor, plus the unsliced ones whole
    trainer.run("ref.release()")
    wait_object(gpuobj_cluster, namespace, "policy", lambda o: o is None)
    finish(gpuobj_cluster, namespace, pods, token_file, trainer, readers)
