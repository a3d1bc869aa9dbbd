"""The registry of diagnostic codes: one entry per code, stable forever.

E1xx syntax, E2xx names/types/units/imports (E22x model shapes), E3xx clusters and meshes, E4xx placement
and sharding, E5xx training and memory, E6xx schedules, E7xx what `plandsl run` refuses
(valid plans the interpreter cannot run) or `plandsl launch` cannot submit as one job, E8xx what `plandsl generate --from` cannot keep,
`plandsl shrink` cannot do, `plandsl import` cannot read or `plandsl export` cannot write; E9xx what `plandsl inspect` cannot derive from a torch module; W for warnings. The examples and fixes live in
`plandsl/diagnostics/catalogue/`, one module per family (shown by `plandsl explain` and
docs/errors.md).
"""
from __future__ import annotations

CODES: dict[str, str] = {
    # E1xx: the text is not a plan
    "E101": "unexpected token",
    "E102": "unexpected end of file",
    "E103": "unterminated string",
    "E104": "invalid character",
    "E105": "file is not UTF-8 text",
    "E106": "input too large or too deeply nested",
    "E107": "not a regular file",
    "E108": "internal error (a plandsl bug)",
    "E109": "file cannot be read",
    # E2xx: names, types, units, imports
    "E201": "unknown name",
    "E202": "duplicate definition",
    "E203": "wrong unit",
    "E204": "unknown unit",
    "E205": "wrong type of value",
    "E206": "unknown attribute",
    "E207": "missing attribute",
    "E208": "import not found",
    "E209": "import cycle",
    "E210": "value not allowed here",
    "E211": "bad arithmetic",
    "E212": "unknown model family or argument",
    "E213": "duplicate attribute",
    "E214": "import outside the search path",
    "E215": "model's layer table missing or stale (run plandsl inspect)",
    "E216": "malformed measured table (GEMMs of a device, collectives of a link)",
    "E217": "measured GEMM table inconsistent with the device's peak",
    # E22x: model shapes (what the model's torch module needs to run)
    "E220": "hidden size not divisible by attention heads",
    "E221": "attention heads not divisible by key/value heads",
    "E222": "odd head dimension under rotary embeddings",
    "E223": "top_k outside 1 to experts",
    "E224": "training sequence longer than the model's learned positions",
    "E225": "shared experts on a model without experts",
    "E226": "multi-head latent attention argument without kv_lora_rank",
    "E227": "kv_heads differs from heads under multi-head latent attention",
    "E228": "dense_layers leaves no mixture-of-experts layer",
    "E229": "dense layers on a model without experts (or dense_ffn without dense_layers)",
    # E3xx: clusters and meshes
    "E301": "mesh needs more devices than the cluster has",
    "E302": "unknown mesh axis",
    "E303": "axis used twice in one sharding",
    "E304": "duplicate mesh axis",
    "E305": "mesh axis size must be a positive integer",
    "E306": "parallelism needs a mesh axis",
    "E307": "mesh axis used by two parallelisms",
    # E4xx: placement and sharding
    "E401": "layer placed on two stages",
    "E402": "layer not placed on any stage",
    "E403": "empty pipeline stage",
    "E404": "stage count does not match the pipeline axis",
    "E405": "selector matches no layer",
    "E406": "dimension not divisible by the axes it is sharded over",
    "E407": "conflicting shard rules",
    "E408": "invalid placement",
    "E409": "invalid stage-to-rank map",
    "E410": "layers out of order across stages",
    "E411": "expert parallel on a model without experts",
    "E412": "tied parameters on different pipeline stages",
    "E413": "tensor parallel over a torch model with no tensor-parallel plan",
    "E414": "a tensor-parallel style the module cannot take",
    "E415": "a sample of a model that takes images split or sized as a sequence (spatial sharding)",
    # E5xx: training, batch, memory
    "E501": "global batch not divisible by data parallel size x micro-batch",
    "E502": "too few microbatches for the schedule",
    "E503": "estimated memory exceeds the device",
    "E504": "precision not supported by the device",
    "E505": "count above plandsl's limit",
    "E506": "a microbatch too small for the model's BatchNorm",
    "E507": "batch shares not one per data rank",
    "E508": "batch shares that do not sum to the global batch",
    "E509": "a batch share that is not whole microbatches",
    # E6xx: schedules
    "E601": "unknown schedule",
    "E602": "action refers to a stage or microbatch that does not exist",
    "E603": "missing action",
    "E604": "duplicated action",
    "E605": "action before the action it depends on",
    "E606": "schedule deadlocks",
    "E607": "stage on more than one rank",
    "E608": "schedule template error",
    "E609": "schedule too large to lay out",
    # E7xx: what `plandsl run` cannot run or `plandsl launch` cannot submit (the plan is valid; they refuse it)
    "E701": "schedule the interpreter cannot run",
    "E702": "parallelism the backend cannot run",
    "E703": "parallelisms the interpreter cannot combine",
    "E704": "model with no torch module to run",
    "E705": "shard rule the interpreter cannot run",
    "E706": "precision the interpreter cannot run",
    "E707": "mesh whose nodes one cluster job cannot start",
    # E8xx: what `plandsl generate --from` cannot keep, or `plandsl shrink` cannot do
    "E801": "decision the search cannot keep",
    "E802": "plan that cannot be scaled down",
    "E803": "no plan keeps the partial plan's decisions",
    # E804-E808: what `plandsl import` cannot read of another tool's configuration, `plandsl export` cannot write
    "E804": "unknown, missing or malformed flag",
    "E805": "contradictory flags",
    "E806": "world size not divisible by the parallel degrees",
    "E807": "setting plandsl cannot express",
    "E808": "part of the plan the target cannot express",
    # E9xx: what `plandsl inspect` cannot derive from a user's torch module
    "E901": "model cannot be imported",
    "E902": "model cannot be built as a torch module",
    "E903": "model forward fails on meta tensors",
    "E904": "no block list found in the model",
    # warnings
    "W201": "unused definition or parameter",
    "W202": "top_k on a model without experts",
    "W301": "mesh uses only part of the cluster",
    "W302": "tensor parallel axis spans nodes",
}
