"""Parallel topology model: memory and communication per layout, feasibility, launch settings, measured comparison.

``docs/method.md#topology``: TP16 baseline; TP8+PP2 (each node one pipeline stage, per-GPU weights ``(W/2)/8 = W/16`` like
TP16, only stage-boundary activations cross nodes); attention TP8/DP2 + MoE EP16 (attention replicated per DP
group, experts spread over all 16 GPUs; all-to-all instead of all-reduce). M3 (``docs/method.md#milestones``) asks
for each layout's memory, communication, TTFT, TPOT and TPS and the evidence for the recommended and rejected ones; before any
launch, the model says which layouts fit.

Notation (SGLang's flags, which the reference deployment uses): ``TP16+DP2+EP16`` is ``--tp-size 16 --dp-size 2
--enable-dp-attention --ep-size 16``: the TP group of a pipeline stage has ``tp`` GPUs; with DP attention the
attention runs as ``dp`` groups of ``tp/dp`` GPUs; experts are split over ``ep`` GPUs, each expert sharded
``tp/ep`` ways. ``PPn`` multiplies the GPU count by n. For vLLM the same layout is launched as
``tp/dp`` × ``dp`` with expert parallelism (:func:`engine_launch_settings`, asked of the engine adapter).

Model assumptions (stated so a reader can disagree):

- parameters: per layer from the HF config (GQA or MLA attention, dense SwiGLU MLP, routed + shared experts,
  router), embeddings and lm_head (untied unless ``tie_word_embeddings``), RMSNorm weights;
- placement: attention projections sharded over the attention-TP group, except MLA's down-projections
  (``q_a_proj``, ``kv_a_proj_with_mqa``) which SGLang keeps replicated; norms and the router replicated; dense
  MLP, shared experts, embeddings and lm_head sharded over the full TP group; routed experts over ``ep × tp/ep =
  tp`` GPUs; pipeline stages split layers as vLLM/SGLang's ``get_pp_indices`` (remainder to the stages before
  the last);
- bytes per weight: ``bf16`` 2, ``fp8`` 1 + fp32 scale per 128×128 block, ``nvfp4`` ½ + fp8 scale per 16,
  ``mxfp4`` ½ + e8m0 scale per 32, ``int4`` ½ + fp16 scale per 128;
- KV cache per token and layer: MLA ``kv_lora_rank + qk_rope_head_dim`` elements, replicated on every rank of
  the attention group; GQA ``2 · kv_heads · head_dim`` split over the attention group (at least one head per
  GPU); each attention group stores the KV of its own requests (requests split evenly over DP groups);
- memory budget per GPU: ``gpu_memory × mem_fraction`` holds weights + KV (SGLang's ``mem-fraction-static``);
- communication per step for ``tokens`` tokens (decode: one per running request): ring all-reduce of the hidden
  state after attention and after the FFN (``2(n−1)/n`` of the message sent per GPU), DP-attention ↔ TP FFN as
  all-gather + reduce-scatter (same volume), EP dispatch (``k`` copies of the hidden state per token, fp8 with
  per-128 scales) and combine (``k`` bf16 copies) with uniform routing, PP send of hidden + residual per stage
  boundary (sliced over the TP ranks). Cross-node traffic counts bytes leaving one node; the time estimate divides
  by the node's rail bandwidth — a lower bound, not a measurement.

Modules: model (HF config, parameter counts, bytes per weight), layout (layouts, the cluster, structural
problems, per-engine launch settings and commands), memory (weights and KV per GPU, feasibility), comm
(collectives per step, cross-node bytes), measured (runs of each layout compared with the model), figures.
Phase 4 (``phase4_topology``) composes them.
"""
from servelab.analyse.topology.comm import CommInputs, comm_summary, comm_table
from servelab.analyse.topology.figures import comm_figure, memory_figure
from servelab.analyse.topology.layout import (Cluster, Layout, cluster_from_target, engine_launch_settings,
                                              launch_commands, layout_problems, layout_target, parse_layout,
                                              pp_partition, reference_layouts)
from servelab.analyse.topology.measured import layout_of_manifest, measured_comparison
from servelab.analyse.topology.memory import (MemoryInputs, feasibility, kv_bytes_per_token, memory_table,
                                              stage_weights_bytes)
from servelab.analyse.topology.model import (DTYPE_BYTES, GIB, KV_DTYPE_BYTES, LayerParams, ModelConfig, active_params,
                                             dtype_bytes, layer_params, load_model_config, model_config_from_dict,
                                             models_dir, param_summary)

__all__ = ["CommInputs", "comm_summary", "comm_table", "comm_figure", "memory_figure", "Cluster", "Layout",
           "cluster_from_target", "engine_launch_settings", "launch_commands", "layout_problems", "layout_target",
           "parse_layout", "pp_partition", "reference_layouts", "layout_of_manifest", "measured_comparison",
           "MemoryInputs", "feasibility", "kv_bytes_per_token", "memory_table", "stage_weights_bytes", "DTYPE_BYTES",
           "GIB", "KV_DTYPE_BYTES", "LayerParams", "ModelConfig", "active_params", "dtype_bytes", "layer_params",
           "load_model_config", "model_config_from_dict", "models_dir", "param_summary"]
