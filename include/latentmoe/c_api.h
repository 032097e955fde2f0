/* latentmoe's C ABI: the library behind a stable, versioned C interface, for bindings that must not be
 * rebuilt for every Python or PyTorch version (the Python package calls it through ctypes:
 * docs/PYTHON.md) and for any language with a C FFI.
 *
 * Shape of the interface:
 *  - Opaque handles: lmoe_context (one tensor-parallel rank: backend, scratch, communicator), lmoe_layer
 *    (latentmoe::Runner: one MoE layer of that rank), lmoe_tail (latentmoe::Tail: the tail alone).
 *    A layer or tail keeps its context alive: destroying handles in any order is safe.
 *  - Every function returns an int status: LMOE_OK, LMOE_INVALID_ARGUMENT (the caller's input is wrong:
 *    a shape, dtype, device, name, config key, file, a token count above max_tokens, a tier that cannot
 *    run) or LMOE_RUNTIME_ERROR (anything else: out of memory, a CUDA or NCCL failure, a collective that
 *    timed out). lmoe_last_error() then returns the library's one-line message (per thread, valid until
 *    the thread's next call). No function aborts the process or lets a C++ exception out.
 *  - Plain structs. Option structs start with struct_size (set it to sizeof the struct you were compiled
 *    with; a smaller, older one is refused, never read past its end). lmoe_tensor's layout is fixed for an
 *    ABI version; lmoe_abi_version() returns LMOE_ABI_VERSION of the library, which a binding compares
 *    with the version it was written for.
 *  - Tensors are described, never owned or allocated: lmoe_tensor {data, dtype, ndim, shape, strides,
 *    device}; the library reads and writes the caller's memory in place.
 *  - CUDA streams are passed as void* (a cudaStream_t). 0 means CUDA's legacy default stream (as in CUDA,
 *    and as PyTorch's default stream is), not a stream of the library's.
 *
 * Threading: a context and everything built on it is used by one thread at a time; the ranks of a
 * simulated group are driven by one thread each (their collectives wait for one another). */
#ifndef LATENTMOE_C_API_H_
#define LATENTMOE_C_API_H_

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__) || defined(__clang__)
#define LMOE_API __attribute__((visibility("default")))
#else
#define LMOE_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a function, struct or code below changes incompatibly. Version 3: the kernel order
 * (lmoe_mxfp4_to_kernel_order's result) pairs adjacent columns; codes converted by a version 2 library must be
 * converted again from the canonical order. */
#define LMOE_ABI_VERSION 3

/* Status codes. */
#define LMOE_OK 0
#define LMOE_INVALID_ARGUMENT 1
#define LMOE_RUNTIME_ERROR 2

/* Element types (lmoe_tensor.dtype). */
#define LMOE_DTYPE_AUTO (-1) /* lmoe_layer_load: the checkpoint's own (its latent down-projection's) */
#define LMOE_DTYPE_F32 0
#define LMOE_DTYPE_BF16 1
#define LMOE_DTYPE_F16 2
#define LMOE_DTYPE_I32 3
#define LMOE_DTYPE_U8 4

/* Devices (lmoe_tensor.device_type, lmoe_context_options.device_type). */
#define LMOE_DEVICE_CPU 0
#define LMOE_DEVICE_CUDA 1

/* Tail tiers (DESIGN section 2), as latentmoe::TailTier; AUTO lets the tier policy choose. */
#define LMOE_TIER_AUTO (-1)
#define LMOE_TIER_NATIVE 0
#define LMOE_TIER_TAIL_FUSION 1
#define LMOE_TIER_ALLREDUCE_OVERLAP 2
#define LMOE_TIER_COLUMN_PARALLEL 3

/* The order of MXFP4 expert codes (lmoe_layer_weights.expert_code_order; latentmoe::Mxfp4CodeOrder). */
#define LMOE_MXFP4_ORDER_CANONICAL 0 /* the checkpoint's: every host tensor */
#define LMOE_MXFP4_ORDER_KERNEL 1    /* what the CUDA kernels read: device codes after lmoe_mxfp4_to_kernel_order */

/* Bytes of an ncclUniqueId. */
#define LMOE_NCCL_UNIQUE_ID_BYTES 128

/* A tensor the caller owns. ndim 0 means "no tensor" (an optional input left out); otherwise 1..4 with
 * shape and strides (in elements) in the first ndim entries. latentmoe takes contiguous row-major
 * tensors: other strides are refused with LMOE_INVALID_ARGUMENT. device_index is the CUDA ordinal (0 for
 * the CPU). */
typedef struct lmoe_tensor {
  void* data;
  int32_t dtype;
  int32_t ndim;
  int64_t shape[4];
  int64_t strides[4];
  int32_t device_type;
  int32_t device_index;
} lmoe_tensor;

typedef struct lmoe_context lmoe_context;
typedef struct lmoe_layer lmoe_layer;
typedef struct lmoe_tail lmoe_tail;

/* --- the library --------------------------------------------------------------------------------- */

LMOE_API int32_t lmoe_abi_version(void);
/* "0.1.0" */
LMOE_API const char* lmoe_version(void);
/* The message of this thread's last failed call ("" when none failed). */
LMOE_API const char* lmoe_last_error(void);

typedef struct lmoe_build_info {
  uint32_t struct_size;
  int32_t has_cuda;          /* built with the CUDA backend */
  int32_t has_nccl;          /* built with NCCL (RankContext over a process group or an ncclComm_t) */
  int32_t nccl_version_code; /* NCCL_VERSION_CODE built against (0 without NCCL) */
  int32_t cuda_device_count; /* CUDA devices seen now (0 without CUDA or a GPU) */
} lmoe_build_info;
LMOE_API int lmoe_get_build_info(lmoe_build_info* info);

/* A Hugging Face style config (JSON text; aliases accepted, unknown keys ignored: docs/CONFIG.md) parsed
 * and validated, written back with the primary key names (LayerConfig::to_json) into out[0..out_size)
 * with a terminating NUL. *needed receives the bytes required including the NUL; when out_size is too
 * small nothing is written and LMOE_OK is returned (call again with a larger buffer). */
LMOE_API int lmoe_config_normalize(const char* config_json, char* out, size_t out_size, size_t* needed);

/* Whether a layer of this config can be split over tp ranks (tp divides d, l, I and Is; with MXFP4 experts
 * I / tp is a multiple of 32): LMOE_INVALID_ARGUMENT naming the first size that does not divide. */
LMOE_API int lmoe_config_check_parallel(const char* config_json, int32_t tp);

/* --- contexts: one tensor-parallel rank ---------------------------------------------------------- */

typedef struct lmoe_context_options {
  uint32_t struct_size;
  int32_t device_type;  /* LMOE_DEVICE_CPU or LMOE_DEVICE_CUDA */
  int32_t device_index; /* CUDA ordinal (0 on the CPU) */
  int64_t max_tokens;   /* the most tokens one forward of any layer or tail of the context takes */
} lmoe_context_options;

/* One rank alone (tp 1). */
LMOE_API int lmoe_context_create(const lmoe_context_options* options, lmoe_context** out);

/* tp ranks in this process: out[0..tp) (CPU: ranks as threads over the in-process group; CUDA: ranks
 * simulated on one GPU, each with its own streams, their collectives in the GPU's memory). Each context is
 * driven by its own thread, and on CUDA each rank's calls go to a stream of its own (the default stream is
 * refused: the ranks' collectives wait for one another). A simulated GPU group carries one dtype and is
 * sized for max_tokens tokens of d + l elements, taken from the first layer or tail built on any of its
 * contexts; it needs CUDA_DEVICE_MAX_CONNECTIONS >= 4 tp (32 from tp 8 on) and CUDA_MODULE_LOADING=EAGER
 * set before the process initialised CUDA (latentmoe/gpu_group.h). */
LMOE_API int lmoe_simulated_group_create(int32_t tp, const lmoe_context_options* options, lmoe_context** out);

/* One process per GPU over NCCL. Rank 0 makes an id and sends it to every rank (e.g. over a
 * torch.distributed group); each rank then calls lmoe_context_create_nccl, which is collective
 * (ncclCommInitRank on options->device_index). The loaded libnccl must be the release latentmoe was built
 * against and NCCL_NVLS_ENABLE must be "0" in the environment (latentmoe keeps NVLink multicast off and
 * sets no NCCL variable itself); both are checked first. The context owns the communicator and destroys it
 * after everything built on it. The first layer or tail built on a context is collective too (its
 * one-shot buffers are registered as an NCCL window): every rank builds its layers in the same order. */
LMOE_API int lmoe_nccl_unique_id(uint8_t* id, size_t id_size);
/* The checks lmoe_context_create_nccl makes before ncclCommInitRank (the libnccl release, NCCL_NVLS_ENABLE),
 * on their own: a binding runs them on every rank and agrees on the result before the collective init, so
 * that no rank waits in ncclCommInitRank for a peer that refused. */
LMOE_API int lmoe_nccl_check(void);
LMOE_API int lmoe_context_create_nccl(const lmoe_context_options* options, int32_t tp, int32_t rank, const uint8_t* id,
                                      size_t id_size, lmoe_context** out);
/* The same over the caller's communicator (an ncclComm_t, not owned: it must outlive the context),
 * initialised with NCCL_NVLS_ENABLE=0; tp and rank are the communicator's. */
LMOE_API int lmoe_context_create_from_nccl_comm(const lmoe_context_options* options, void* nccl_comm,
                                                lmoe_context** out);

/* Releases the caller's reference; the context lives on while a layer or tail built on it does. */
LMOE_API int lmoe_context_destroy(lmoe_context* context);

typedef struct lmoe_context_info {
  uint32_t struct_size;
  int32_t tp;
  int32_t rank;
  int32_t device_type;
  int32_t device_index;
  int64_t max_tokens;
  int32_t num_layers; /* layers and tails built on the context and alive */
  int32_t frozen;     /* a forward has run through it: its buffers no longer move */
} lmoe_context_info;
LMOE_API int lmoe_context_get_info(const lmoe_context* context, lmoe_context_info* info);

/* The communicator's check point (GPU groups): after the caller has synchronised the rank's stream,
 * reports a collective that failed on the device (a peer that never came, an abort). */
LMOE_API int lmoe_context_check(lmoe_context* context);
/* Gives up on the group after a failure on some rank: peers blocked in a collective, now or later, fail
 * instead of waiting for their timeout. */
LMOE_API int lmoe_context_abort(lmoe_context* context);

/* --- layers ------------------------------------------------------------------------------------------ */

/* The tier policy (latentmoe::TierPolicy). A field < 0 keeps the default, which is tuned_policy's for the
 * layout (latentmoe/tune.h: built-in tables for the GPU where each rank has its own, LATENTMOE_TUNE_FILE,
 * the LATENTMOE_* variables), read once when the layer or tail is made. NULL: all defaults. */
typedef struct lmoe_tier_policy {
  uint32_t struct_size;
  int64_t tail_fusion_max_tokens;
  int64_t shared_stream_token_threshold;
  int32_t disable_shared_stream; /* 0 or 1; < 0 default */
  int32_t disable_tail_fusion;   /* 0 or 1; < 0 default */
} lmoe_tier_policy;

/* This rank's shard of a layer's weights, in the stacked layout of latentmoe/weights.h (LayerWeightViews):
 * gate [E+Z, d] f32 (optional), score_bias [E+Z] f32 (optional), down_proj [l, d], latent_norm [l] f32
 * (iff latent_moe_use_norm), up_proj [d, l], expert_gate/up [E, I/tp, l] (gate iff gated), expert_down
 * [E, l, I/tp]; MXFP4 experts: U8 codes gate/up [E, I/tp, l/2], down [E, l, I/tp/2] and the *_scale
 * fields U8 [E, I/tp, l/32], [E, l, I/tp/32]; shared_gate/up [Is/tp, d], shared_down [d, Is/tp]. Matrices
 * in `dtype`. Host tensors are copied to the context's device; tensors already on it are used in place
 * and must stay alive and unchanged while the layer lives. MXFP4 codes on the GPU must be in the kernel order
 * (lmoe_mxfp4_to_kernel_order, once per tensor) with expert_code_order LMOE_MXFP4_ORDER_KERNEL; host codes are
 * canonical (LMOE_MXFP4_ORDER_CANONICAL, which a zeroed struct holds) and converted by the layer after its copy. */
typedef struct lmoe_layer_weights {
  uint32_t struct_size;
  int32_t dtype; /* the compute dtype: LMOE_DTYPE_F32, _BF16 or _F16 */
  lmoe_tensor gate, score_bias, down_proj, latent_norm, up_proj;
  lmoe_tensor expert_gate, expert_up, expert_down;
  lmoe_tensor expert_gate_scale, expert_up_scale, expert_down_scale;
  lmoe_tensor shared_gate, shared_up, shared_down;
  int32_t expert_code_order; /* MXFP4 codes: LMOE_MXFP4_ORDER_CANONICAL or _KERNEL (since ABI version 2) */
} lmoe_layer_weights;

/* MXFP4 codes on a CUDA device (U8, contiguous: expert_gate, expert_up or expert_down of this rank) from the
 * canonical order to the kernel order the CUDA kernels read, in place (latentmoe::mxfp4_to_kernel_order):
 * enqueued on `stream` (0: the legacy default stream) of the device that holds them. Convert each tensor once,
 * before the layer that uses it in place is created with expert_code_order LMOE_MXFP4_ORDER_KERNEL. */
LMOE_API int lmoe_mxfp4_to_kernel_order(const lmoe_tensor* codes, void* stream);

/* A layer from its config (JSON text) and this rank's shard. Build every layer and tail of a context
 * before its first forward (the context's buffers are sized then and never move after it). */
LMOE_API int lmoe_layer_create(lmoe_context* context, const char* config_json, const lmoe_layer_weights* weights,
                               const lmoe_tier_policy* policy, lmoe_layer** out);
/* A layer whose weights are read from a checkpoint: a safetensors file, a folder (its index, or its one
 * .safetensors file) or a model.safetensors.index.json; names under `prefix` (may be ""), only this rank's
 * slices read from the memory-mapped shards. dtype: the compute dtype, or LMOE_DTYPE_AUTO for the
 * checkpoint's own (that of routed_expert_down_proj.weight / fc1_latent_proj.weight). */
LMOE_API int lmoe_layer_load(lmoe_context* context, const char* config_json, const char* path, const char* prefix,
                             int32_t dtype, const lmoe_tier_policy* policy, lmoe_layer** out);
LMOE_API int lmoe_layer_destroy(lmoe_layer* layer);

typedef struct lmoe_layer_info {
  uint32_t struct_size;
  int32_t dtype;
  int32_t device_type;
  int32_t device_index;
  int32_t has_gate; /* router logits may be left out */
  int64_t hidden_size;
  int64_t latent_size;
  int64_t top_k;
  int64_t num_router_outputs; /* E + Z */
  int64_t max_tokens;
} lmoe_layer_info;
LMOE_API int lmoe_layer_get_info(const lmoe_layer* layer, lmoe_layer_info* info);

/* The tier the policy picks for num_tokens tokens (inside what the layer supports). */
LMOE_API int lmoe_layer_select_tier(const lmoe_layer* layer, int64_t num_tokens, int32_t* tier);
/* What each tier can run, as JSON text ({"native": {"supported": true, "max_tokens": N | null, "reason":
 * "..."}, ..., "collectives": "..."}), written as lmoe_config_normalize writes. */
LMOE_API int lmoe_layer_describe_tiers(const lmoe_layer* layer, char* out, size_t out_size, size_t* needed);

/* One forward of the layer (latentmoe::Runner::forward): hidden_states [T, d] in the layer's dtype;
 * router_logits [T, E+Z] f32 or NULL (then computed from gate); latent_states [T, l] or NULL; output
 * [T, d]; topk_ids [T, k] i32 and topk_weights [T, k] f32, each optional (NULL). All on the context's
 * device. tier: LMOE_TIER_*; *tier_run (optional) receives the tier that ran. CUDA: enqueued on `stream`,
 * no allocation, no host synchronisation: capturable into a CUDA graph. */
LMOE_API int lmoe_layer_forward(lmoe_layer* layer, const lmoe_tensor* hidden_states, const lmoe_tensor* router_logits,
                                const lmoe_tensor* latent_states, const lmoe_tensor* output,
                                const lmoe_tensor* topk_ids, const lmoe_tensor* topk_weights, int32_t tier,
                                void* stream, int32_t* tier_run);

/* --- the tail alone (latentmoe/tail.h) --------------------------------------------------------------- */

/* up_proj: W_up [d, l] whole (replicated) in `dtype`; latent_norm: [l] f32, or NULL / ndim 0 for no latent
 * norm. Device tensors are used in place (keep them alive), host ones copied. */
LMOE_API int lmoe_tail_create(lmoe_context* context, int64_t hidden_size, int64_t latent_size,
                              const lmoe_tensor* latent_norm, const lmoe_tensor* up_proj, double eps, int32_t dtype,
                              const lmoe_tier_policy* policy, lmoe_tail** out);
LMOE_API int lmoe_tail_destroy(lmoe_tail* tail);
LMOE_API int lmoe_tail_select_tier(const lmoe_tail* tail, int64_t num_tokens, int32_t* tier);
LMOE_API int lmoe_tail_describe_tiers(const lmoe_tail* tail, char* out, size_t out_size, size_t* needed);
/* out [T, d] = the layer output from this rank's S_r (shared_partial [T, d]) and L_r (latent_partial
 * [T, l]); the inputs are not modified. As lmoe_layer_forward otherwise. */
LMOE_API int lmoe_tail_forward(lmoe_tail* tail, const lmoe_tensor* shared_partial, const lmoe_tensor* latent_partial,
                               const lmoe_tensor* out, int32_t tier, void* stream, int32_t* tier_run);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* LATENTMOE_C_API_H_ */
