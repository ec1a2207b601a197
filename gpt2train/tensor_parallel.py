"""How a GPT's blocks are split over the tensor-parallel ranks (tensor_parallel=N; Megatron-LM's layout, built on
PyTorch's DTensor engine, parallelize_module). In each block the attention's heads and the MLP's hidden units are
divided among the N ranks of a group: c_attn and c_fc column-wise (each rank computes q, k, v of its n_head / N
heads, and 4 * n_embd / N hidden units, from the whole residual stream), both c_proj row-wise (each rank's partial
sum, all-reduced: two all-reduces of the (B, T, n_embd) stream forward and two backward per block). Everything
else is replicated over the group, every rank holding it whole and computing it alike on the same rows: wte (the
tied output head), wpe, the LayerNorms, ln_f and the chunked loss (ChunkedLMHeadLoss keeps its memory bound on
the whole hidden state; a vocabulary-parallel loss would be another op). Sequence parallelism is not used.

The fused c_attn holds rows q; k; v (n_embd each); rank r needs rows r of each. A plain Shard(0) would give rank 0
all of q and half of k, and DTensor's _StridedShard (the honest description) is neither written by DCP nor
composed by FSDP. So the parameter is held as the same matrix with its rows in rank order, [q_0 k_0 v_0 | q_1 k_1
v_1 | ...] (qkv_order), sharded Shard(0) like any column-wise weight: FSDP, AdamW, the gradient norm and every
collective see an ordinary DTensor. Wherever a whole tensor crosses into or out of it, the rows are put in
order: a new parameter's initial values (model_rows), gathered() weights (whole), and checkpoints (DCP: to_saved /
from_saved, in GPT-2's layout with the same keys as every other run, so they load at any layout).
"""

import logging

import torch

FUSED_QKV = ("attn.c_attn.weight", "attn.c_attn.bias")  # name endings of the parameters held in rank order


def split_blocks(model, tp_mesh):
    """Split each block of the bare GPT over tp_mesh (a 1-D DeviceMesh), in place. Each rank slices its part of
    the weights the model holds (every rank built the same ones; src_data_rank=None: no broadcast), or of the
    meta tensors that parallel.materialise fills later."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    # DTensor warns, per rank, each time a 2-D (FSDP x TP) value is reduced or gathered one mesh dim after the
    # other: the gradient norm (a scalar) every step, c_attn at checkpoints; neither is worth a line per rank
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    tp = tp_mesh.size()
    plan = {
        "attn.c_attn": ColwiseParallel(),
        "attn.c_proj": RowwiseParallel(),
        "mlp.c_fc": ColwiseParallel(),
        "mlp.c_proj": RowwiseParallel(),
    }
    for style in plan.values():
        style.src_data_rank = None
    for block in model.transformer.h.children():  # a ModuleList, or a pipeline stage's ModuleDict
        with torch.no_grad():
            for p in block.attn.c_attn.parameters():
                if p.device.type != "meta":
                    p.copy_(p[qkv_order(p.size(0), tp)])
        parallelize_module(block, tp_mesh, plan)


def qkv_order(rows, tp):
    """The rank order of c_attn's rows (q; k; v, rows / 3 each) for tp ranks: whole[qkv_order(...)] puts rank 0's
    rows of q, k and v first, then rank 1's, ..."""
    return torch.arange(rows).view(3, tp, rows // (3 * tp)).transpose(0, 1).reshape(-1)


def tp_size(tensor):
    """Over how many tensor-parallel ranks `tensor` (a parameter, or its optimizer state) is split: 1 for a plain
    tensor or a DTensor on a mesh without a 'tp' dim."""
    from torch.distributed.tensor import DTensor  # here: DTensor's import costs ~1 s, and only split runs need it

    if not isinstance(tensor, DTensor) or "tp" not in (tensor.device_mesh.mesh_dim_names or ()):
        return 1
    return tensor.device_mesh["tp"].size()


def model_rows(name, whole, like):
    """whole (a parameter's values in GPT-2's layout) in the row order the DTensor `like` holds: c_attn's rows put
    in rank order under tensor parallelism, every other tensor as it is."""
    return whole[qkv_order(whole.size(0), tp_size(like))] if _in_rank_order(name, whole, like) else whole


def gpt2_rows(name, whole, like):
    """The inverse of model_rows: whole (in `like`'s row order) in GPT-2's layout."""
    return whole[qkv_order(whole.size(0), tp_size(like)).argsort()] if _in_rank_order(name, whole, like) else whole


def _in_rank_order(name, whole, like):
    """Whether `like` holds whole's rows in rank order: c_attn's weight or bias (or an AdamW moment of one, not
    its step count) split over tensor-parallel ranks."""
    return name.endswith(FUSED_QKV) and tp_size(like) > 1 and whole.shape == like.shape


def whole(name, tensor):
    """The whole value of a parameter `name` (a collective for a DTensor: every rank calls it) in GPT-2's layout."""
    from torch.distributed.tensor import DTensor

    return gpt2_rows(name, tensor.full_tensor(), tensor) if isinstance(tensor, DTensor) else tensor


def _reordered(name, value, to_saved):
    """A DTensor of value's placements holding its values with the rows put in GPT-2's order (to_saved) or back in
    rank order: through the whole tensor (a transient copy, one parameter at a time), each rank keeping its part."""
    from torch.distributed.tensor import distribute_tensor

    rows = gpt2_rows if to_saved else model_rows
    full = rows(name, value.full_tensor(), value)
    return distribute_tensor(full, value.device_mesh, value.placements, src_data_rank=None)


def _convert(state, to_saved):
    """{'model': state dict, 'optimizer': optimizer state dict (optional; nested, or flattened as a pipeline stage's)}
    as get_state_dict gives them, with c_attn's tensor-parallel values (and their AdamW moments) reordered
    (_reordered); new dicts, the rest shared."""
    if not any(tp_size(v) > 1 for v in state["model"].values()):
        return state

    def fix(name, value):
        return _reordered(name, value, to_saved) if tp_size(value) > 1 and name.endswith(FUSED_QKV) else value

    out = {**state, "model": {name: fix(name, v) for name, v in state["model"].items()}}
    optimizer = state.get("optimizer")
    if optimizer is not None and "state" in optimizer:
        moments = {name: {k: fix(name, v) for k, v in s.items()} for name, s in optimizer["state"].items()}
        out["optimizer"] = {**optimizer, "state": moments}
    elif optimizer is not None:  # flattened (a pipeline stage's): 'state.<parameter>.exp_avg' -> value
        out["optimizer"] = {key: fix(key.rpartition(".")[0], v) for key, v in optimizer.items()}
    return out


def to_saved(state):
    """A sharded checkpoint's {'model', 'optimizer'} state in GPT-2's layout (every rank calls it: collectives)."""
    return _convert(state, True)


def from_saved(state):
    """to_saved's inverse: state read from a checkpoint, in the layout the model holds."""
    return _convert(state, False)
