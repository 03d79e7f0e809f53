"""Names a user types or a manifest carries: the API contract of gpuobj in one place.

Every module, manifest generator and test reads these; nothing spells them again.
"""

from __future__ import annotations

from gpuobj_contract.layouts import DEVICES_PATTERN, DTYPE_BYTES

GROUP = "gpuobj.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

KIND_OBJECT = "GPUObject"
PLURAL_OBJECT = "gpuobjects"
KIND_CLAIM = "GPUObjectClaim"
PLURAL_CLAIM = "gpuobjectclaims"
KIND_STREAM = "GPUObjectStream"
PLURAL_STREAM = "gpuobjectstreams"
CATEGORY = "gpuobj"

# Held on every GPUObject until its source agent has acknowledged the free.
FINALIZER_FREE = f"{GROUP}/free"

# Labels and annotations.
LABEL_SOURCE_POD = f"{GROUP}/source-pod"
LABEL_STREAM = f"{GROUP}/stream"
LABEL_OBJECT = f"{GROUP}/object"  # on a claim: the GPUObject it references
LABEL_AGENT = f"{GROUP}/agent"  # on a pod: "true" when it runs a gpuobj agent
# On objects, claims and streams: the bucket of their namespace; operator shards select on it (shard_buckets.py).
LABEL_SHARD_BUCKET = f"{GROUP}/shard-bucket"
ANNOTATION_AGENT_PORT = f"{GROUP}/agent-port"
ANNOTATION_AGENT_HOST = f"{GROUP}/agent-host"  # overrides status.podIP (dev cluster: no kubelet, no pod network)
ANNOTATION_SHARED_BY = f"{GROUP}/shared-by"  # on a claim made for a receiver: the sharing (source) pod
ANNOTATION_SOURCE_ENDPOINT = f"{GROUP}/source-endpoint"  # the source agent, as the client library saw it
ANNOTATION_STREAM_END = f"{GROUP}/stream-end"  # on a stream: readers stop before this item index
# The one claim the operator owns, in the namespace it watches (or its own): it writes it to move its claims
# watch past an object's deletion (operator/gpuobj_operator/progress_marker.py). It holds nothing.
CLAIMS_PROGRESS_MARKER = "gpuobj-claims-progress"
ANNOTATION_PROGRESS = f"{GROUP}/progress"  # on the marker: changed by each write

# Agent defaults.
AGENT_PORT_NAME = "gpuobj-agent"
DEFAULT_AGENT_PORT = 8471
# A pod's projected ServiceAccount token for agents (audience AGENT_AUDIENCE): the operator's proves it is
# the operator, a workload's proves which pod reads. Rotated by the kubelet; re-read on every use.
TOKEN_ENV = "GPUOBJ_TOKEN_FILE"
AGENT_AUDIENCE = "gpuobj.io/agent"
# The operator names the pod uid it means on every control call; an agent serving another pod refuses (409).
HEADER_POD_UID = "Gpuobj-Pod-UID"
# The operator's probe tells an agent its pod's share of the fleet's write budget (writes a second; 0: none).
HEADER_WRITE_RATE = "Gpuobj-Write-Rate"

# Object states (status.state) and condition types.
STATE_PENDING = "Pending"
STATE_READY = "Ready"
STATE_RELEASING = "Releasing"
STATE_LOST = "Lost"
STATE_FAILED = "Failed"
STATES = (STATE_PENDING, STATE_READY, STATE_RELEASING, STATE_LOST, STATE_FAILED)

CONDITION_READY = "Ready"
CONDITION_SOURCE_AVAILABLE = "SourceAvailable"
CONDITION_RELEASED = "Released"
# The Ready condition's reason (and the Event's) of a GPUObject its namespace's byte quota refused.
REASON_QUOTA_EXCEEDED = "QuotaExceeded"

# Dtypes a GPUObject may declare: torch dtype names without the "torch." prefix.
DTYPES = tuple(DTYPE_BYTES)
__all__ = ["DEVICES_PATTERN", "DTYPES"]  # re-exported: layouts.py is their home
