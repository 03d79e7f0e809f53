"""The `gpuobj.io/agent-serving` signer: approves and signs an agent's CSR only for the pod that asked.

Why the operator: it is the one client that must verify every agent, and it already knows agent pods.
Who asked is not what the CSR says but what the API server recorded: `spec.username` (the ServiceAccount)
and `spec.extra` (the pod name and uid of the pod-bound token it was created with; Kubernetes writes
these, the requester cannot). The pod must exist with that uid, run as that ServiceAccount, carry the
agent label, not be terminating, and have an IP. The certificate then names exactly that pod: its IPs,
`<uid>.pod.gpuobj.io` (what callers verify) and `spiffe://gpuobj.io/ns/<ns>/pod/<name>/<uid>`.
A CSR asking for any other name is denied, with the reason in its Denied condition.

`decide` is pure (unit-tested); `Signer` is the I/O: one watch of CSRs, one GET of the pod per CSR.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuobj_contract import agent_tls, names
from gpuobj_kube.client import CSRS, PODS, ApiError, Conflict, KubeClient, NotFound
from gpuobj_kube.informer import Informer
from gpuobj_operator.agent_ca import BadRequest, CertificateAuthority, Requested, parse_request

log = logging.getLogger("gpuobj.signer")

SA_PREFIX = "system:serviceaccount:"
EXTRA_POD_NAME = "authentication.kubernetes.io/pod-name"
EXTRA_POD_UID = "authentication.kubernetes.io/pod-uid"


@dataclass(frozen=True)
class Decision:
    approve: bool
    reason: str  # the condition's message: why denied, or whom it names
    common_name: str = ""
    dns_names: tuple[str, ...] = ()
    ips: tuple[str, ...] = ()
    uris: tuple[str, ...] = ()
    lifetime: dt.timedelta = field(default=dt.timedelta(seconds=agent_tls.MAX_LIFETIME_SECONDS))


def _deny(reason: str) -> Decision:
    return Decision(False, reason)


def requester(csr: dict[str, Any]) -> tuple[str, str, str, str] | None:
    """(namespace, serviceaccount, pod name, pod uid) of a CSR made with a pod-bound token, else None."""
    spec = csr.get("spec") or {}
    user = spec.get("username") or ""
    if not user.startswith(SA_PREFIX):
        return None
    ns, _, sa = user[len(SA_PREFIX) :].partition(":")
    extra = spec.get("extra") or {}
    pod_names, pod_uids = extra.get(EXTRA_POD_NAME) or [], extra.get(EXTRA_POD_UID) or []
    if not ns or not sa or len(pod_names) != 1 or len(pod_uids) != 1:
        return None
    return ns, sa, pod_names[0], pod_uids[0]


def pending(csr: dict[str, Any]) -> bool:
    """Ours, not denied or failed, and not issued yet (an approved one whose signing was cut off counts)."""
    if (csr.get("spec") or {}).get("signerName") != agent_tls.SIGNER_NAME:
        return False
    status = csr.get("status") or {}
    if status.get("certificate"):
        return False
    return not any(c.get("type") in ("Denied", "Failed") for c in status.get("conditions") or [])


def decide(csr: dict[str, Any], pod: dict[str, Any] | None, requested: Requested) -> Decision:
    """Approve only a CSR whose recorded requester is a live agent pod, for that pod's names alone."""
    spec = csr.get("spec") or {}
    if spec.get("signerName") != agent_tls.SIGNER_NAME:
        return _deny(f"not for signer {agent_tls.SIGNER_NAME}")
    who = requester(csr)
    if who is None:
        return _deny("requested with no pod-bound ServiceAccount token (spec.username/extra name no pod)")
    ns, sa, pod_name, pod_uid = who
    usages = set(spec.get("usages") or [])
    if not usages <= set(agent_tls.USAGES) or "server auth" not in usages:
        return _deny(f"usages {sorted(usages)}: only {list(agent_tls.USAGES)} may be asked for")
    if pod is None:
        return _deny(f"pod {ns}/{pod_name} does not exist")
    meta, pspec, pstatus = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    if meta.get("namespace") != ns or meta.get("name") != pod_name:
        return _deny(f"pod {meta.get('namespace')}/{meta.get('name')} is not {ns}/{pod_name}, the token's pod")
    if meta.get("uid") != pod_uid:
        return _deny(f"pod {ns}/{pod_name} is not the pod (uid {pod_uid}) whose token made this request")
    if (meta.get("labels") or {}).get(names.LABEL_AGENT) != "true":
        return _deny(f"pod {ns}/{pod_name} is not labelled {names.LABEL_AGENT}=true")
    if (pspec.get("serviceAccountName") or "default") != sa:
        return _deny(f"pod {ns}/{pod_name} does not run as ServiceAccount {sa}")
    if meta.get("deletionTimestamp"):
        return _deny(f"pod {ns}/{pod_name} is terminating")
    ips = tuple(dict.fromkeys([p.get("ip") for p in pstatus.get("podIPs") or [] if p.get("ip")] or []))
    if not ips and pstatus.get("podIP"):
        ips = (pstatus["podIP"],)
    if not ips:
        return _deny(f"pod {ns}/{pod_name} has no IP yet; ask again once it has one")
    dns = agent_tls.pod_dns_name(pod_uid)
    uri = agent_tls.pod_uri(ns, pod_name, pod_uid)
    extra_names = (
        sorted(requested.dns_names - {dns}) + sorted(requested.ips - set(ips)) + sorted(requested.uris - {uri})
    )
    if extra_names:
        return _deny(f"asks for names that are not pod {ns}/{pod_name}'s: {extra_names}")
    seconds = spec.get("expirationSeconds") or agent_tls.MAX_LIFETIME_SECONDS
    seconds = max(agent_tls.MIN_LIFETIME_SECONDS, min(int(seconds), agent_tls.MAX_LIFETIME_SECONDS))
    return Decision(
        True,
        f"pod {ns}/{pod_name} ({pod_uid}) at {', '.join(ips)}",
        common_name=f"{ns}/{pod_name}",
        dns_names=(dns,),
        ips=ips,
        uris=(uri,),
        lifetime=dt.timedelta(seconds=seconds),
    )


def _condition(kind: str, reason: str, message: str) -> dict[str, Any]:
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "type": kind,
        "status": "True",
        "reason": reason,
        "message": message[:1000],
        "lastUpdateTime": now,
        "lastTransitionTime": now,
    }


class Signer:
    """Watches CSRs for our signer and answers each once: approved and issued, or denied."""

    def __init__(
        self,
        kube: KubeClient,
        ca: CertificateAuthority,
        *,
        namespace: str | None = None,
        owns: Callable[[str], bool] = lambda namespace: True,
    ) -> None:
        self.kube = kube
        self.ca = ca
        # An operator watching one namespace answers only its pods' CSRs (another release's signer, with
        # another CA, answers the rest); a shard's operator only those of its shard's namespaces (shards.py:
        # another shard's replicas answer theirs, so no CSR is answered by two shards).
        self.namespace = namespace
        self.owns = owns
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._queued: set[str] = set()
        self._informer = Informer(kube, CSRS, self._on_csr)
        self._worker: asyncio.Task[None] | None = None
        self._retries: dict[str, int] = {}  # a CSR whose answer failed: failures in a row, for its backoff
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self.issued = 0
        self.denied = 0

    def failure(self) -> str | None:
        """Why this replica has no working signer, or None: /healthz fails on it so the kubelet restarts us.

        The watch gives up after its retry budget (InformerFailed); a 403 (a missing RBAC rule) will not heal
        by retrying, so it counts at once. Without this the replica ran signerless while /healthz said ok."""
        for task in (self._informer.task, self._worker):
            if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
                return f"CSR signer stopped: {task.exception()}"
        last = self._informer.last_error
        if isinstance(last, ApiError) and last.status == 403:
            return f"CSR signer cannot watch certificatesigningrequests: {last}"
        return None

    def _on_csr(self, kind: str | None, csr: dict[str, Any]) -> None:
        name = csr["metadata"]["name"]
        asked_from = (requester(csr) or ("",))[0]
        if (self.namespace is not None and asked_from != self.namespace) or not self.owns(asked_from):
            return
        if kind != "DELETED" and pending(csr) and name not in self._queued:
            self._queued.add(name)
            self._queue.put_nowait(name)

    def start(self) -> None:
        self._informer.start()
        self._worker = asyncio.create_task(self._work(), name="gpuobj-signer")

    async def stop(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        await self._informer.stop()
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker

    async def _work(self) -> None:
        while True:
            name = await self._queue.get()
            self._queued.discard(name)
            try:
                await self.answer(name)
            except asyncio.CancelledError:
                raise
            except Exception:  # one CSR's failure never stops the signer: it is tried again, with backoff
                log.exception("CSR %s: could not answer it; retrying", name)
                self._retry(name)
            else:
                self._retries.pop(name, None)

    def _retry(self, name: str) -> None:
        """Requeue a CSR whose answer failed, after a doubling delay (no new event may come to bring it back)."""
        n = self._retries.get(name, 0)
        self._retries[name] = n + 1
        if name in self._timers:
            return

        def again() -> None:
            self._timers.pop(name, None)
            if name not in self._queued:
                self._queued.add(name)
                self._queue.put_nowait(name)

        self._timers[name] = asyncio.get_running_loop().call_later(min(0.2 * 2.0**n, 30.0), again)

    async def answer(self, name: str) -> Decision | None:
        """Decide on one CSR (read fresh) and write the answer; None when there is nothing to do."""
        try:
            csr = await self.kube.get(CSRS, name)
        except NotFound:
            return None
        if not pending(csr):
            return None
        who = requester(csr)
        pod = None
        if who is not None:
            with contextlib.suppress(NotFound):
                pod = await self.kube.get(PODS, who[2], who[0])
        try:
            requested = parse_request(base64.b64decode((csr.get("spec") or {}).get("request") or ""))
            decision = decide(csr, pod, requested)
        except (BadRequest, ValueError) as exc:
            requested, decision = None, _deny(str(exc))
        try:
            if not decision.approve:
                await self._set_condition(csr, _condition("Denied", "NotThisPod", decision.reason))
                self.denied += 1
                log.warning("CSR %s denied: %s", name, decision.reason)
                return decision
            assert requested is not None
            conditions = (csr.get("status") or {}).get("conditions") or []
            if not any(c.get("type") == "Approved" for c in conditions):
                csr = await self._set_condition(csr, _condition("Approved", "AgentPod", decision.reason))
            cert = self.ca.issue(
                requested.public_key,
                common_name=decision.common_name,
                dns_names=decision.dns_names,
                ips=decision.ips,
                uris=decision.uris,
                lifetime=decision.lifetime,
            )
            # The chain: the leaf, then the CA. Agents take their trust anchor from it (docs/security.md).
            csr.setdefault("status", {})["certificate"] = base64.b64encode(cert + self.ca.cert_pem).decode()
            await self.kube.replace(CSRS, name, csr, subresource="status")
        except Conflict:  # changed meanwhile (another replica answered): its next event brings it back if needed
            log.info("CSR %s changed while we answered it", name)
            return None
        except ApiError as exc:
            log.warning("CSR %s: %s", name, exc)
            raise
        self.issued += 1
        log.info("CSR %s: issued for %s", name, decision.reason)
        return decision

    async def _set_condition(self, csr: dict[str, Any], condition: dict[str, Any]) -> dict[str, Any]:
        status = csr.setdefault("status", {})
        status["conditions"] = [*(status.get("conditions") or []), condition]
        return await self.kube.replace(CSRS, csr["metadata"]["name"], csr, subresource="approval")
