"""A loaded rank handed to another process on the host, without copying it.

- :mod:`.ipc`: export a rank's arena (CUDA IPC, or shared memory on the CPU) and map it elsewhere;
- :mod:`.sidecar_client`: the engine side of ``gdsload serve``'s IPC endpoints.
"""
