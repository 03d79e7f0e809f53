"""The `gpuobj demo` command: the main job a new user runs first."""
