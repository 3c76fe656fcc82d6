"""A world of one for GPU tests and benchmarks that build sglang models outside a server."""

from __future__ import annotations


def init_single_rank_parallel_state() -> None:
    """World of one (gloo), so sglang's parallel layers find their TP group; idempotent."""
    import inspect
    import socket

    from sglang.srt.distributed import parallel_state

    if parallel_state._TP is not None:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    parallel_state.init_distributed_environment(
        world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    sizes = inspect.signature(parallel_state.initialize_model_parallel).parameters
    # 0.5.23 takes no widths: it reads the published runtime settings (tensor parallel 1 by default)
    parallel_state.initialize_model_parallel(**({"tensor_model_parallel_size": 1} if "tensor_model_parallel_size" in sizes
                                                else {}))


def init_tp_parallel_state(world: int, rank: int, port: int, backend: str, mm_attention_backend: str,
                           timeout=None) -> None:
    """One rank of a TP world of `world` ranks: 0.5.17 takes the width as an argument, 0.5.23 reads the
    published server settings and this process's rank."""
    import inspect

    from sglang.srt import runtime_context
    from sglang.srt.distributed import parallel_state
    from sglang.srt.server_args import ServerArgs

    parallel_state.init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend=backend,
                                                distributed_init_method=f"tcp://127.0.0.1:{port}", timeout=timeout)
    if "tensor_model_parallel_size" in inspect.signature(parallel_state.initialize_model_parallel).parameters:
        runtime_context.publish(ServerArgs(model_path="dummy", mm_attention_backend=mm_attention_backend), role="test")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        return
    runtime_context.publish(ServerArgs(model_path="dummy", mm_attention_backend=mm_attention_backend, tp_size=world),
                            role="test", ranks=runtime_context.SpawnRanks(world_rank=rank))
    runtime_context.get_parallel().override_permanently(world_group=parallel_state._WORLD)
    parallel_state.initialize_model_parallel()


def release_single_rank_parallel_state() -> None:
    """Undo init_single_rank_parallel_state: processes this one forks later start without a world."""
    import torch.distributed as dist

    from sglang.srt.distributed import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()
    if dist.is_initialized():
        dist.destroy_process_group()
