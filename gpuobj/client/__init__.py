"""The gpuobj client library: what workloads import (see gpuobj.Client)."""
