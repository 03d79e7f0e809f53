"""The contract every part of gpuobj shares: names, metric names, tensor layouts, the agent's wire types.

Why: the agent, the operator, the client and the benchmarks all speak these; one home each,
and this package imports nothing of gpuobj above it (a layer contract checks it).
"""
