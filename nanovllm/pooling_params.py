"""Pooling models (vLLM's runner="pooling"): PoolingParams, what one request asks of the pooler, and
PoolerConfig, the engine's pooling settings.

A pooling engine runs each prompt through the model once and returns what its final hidden states
give instead of tokens. An embedding model (convert "embed"): "embed" pools a prompt's hidden
states into one vector (its last token's, its first's, or their mean), "token_embed" returns one
vector a token; with use_activation (the default) each vector is scaled to length 1, and dimensions
keeps only the first N features (before the scaling), for models trained with Matryoshka
representations. A classifier (convert "classify", layers/classifier.py): "classify" maps the
pooled vector to its labels' probabilities (with use_activation; else their logits),
"token_classify" each token's.

STEP pooling (vLLM's tok_pooling_type "STEP", a process reward model's default) trims a token task's
result: returned_token_ids keeps those columns of each token's logits (an embedding's features), before
the activation; step_tag_id keeps the rows of the prompt tokens with that id (those that end a step of a
solution), in prompt order.
"""
import copy
import json
import os
from dataclasses import dataclass, fields

from nanovllm.sampling_params import RequestOutputKind
from nanovllm.utils.validation import check_known_keys

EMBED_TASKS = ("embed", "token_embed")              # an embedding model's (vLLM's names)
CLASSIFY_TASKS = ("classify", "token_classify")     # a classifier's
POOLING_TASKS = EMBED_TASKS + CLASSIFY_TASKS
TOKEN_TASKS = ("token_embed", "token_classify")     # a result a prompt token, so no prefix-cache reads
# vLLM's words for the task names it has removed
REMOVED_TASKS = {"score": "`score` task was removed; use `classify` instead.",
                 "encode": "`encode` task was removed; use `token_embed` or `token_classify` instead."}
# vLLM's: the PoolingParams fields each task takes
TASK_PARAMETERS = {"embed": ["dimensions", "use_activation"], "token_embed": ["dimensions", "use_activation"],
                   "classify": ["use_activation"], "token_classify": ["use_activation"]}
SEQ_POOLING_TYPES = ("LAST", "CLS", "MEAN")    # "embed": which of a prompt's hidden states make its vector
TOK_POOLING_TYPES = ("ALL", "STEP")           # the token tasks': every token's, or the rows and columns asked for
STEP_PARAMETERS = ("step_tag_id", "returned_token_ids")


def check_task(task, name: str):
    """A ValueError naming the field (name) unless task is None or one of POOLING_TASKS."""
    if task in REMOVED_TASKS:
        raise ValueError(REMOVED_TASKS[task])
    if task is not None and task not in POOLING_TASKS:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, POOLING_TASKS))}, got {task!r}.")


@dataclass
class PoolerConfig:
    """vLLM's PoolerConfig. Unset fields come from the model's sentence-transformers files
    (modules.json), then from the defaults: LAST, ALL, use_activation. logit_mean and logit_sigma
    calibrate a classifier's logits before its activation: (logit - mean) / sigma."""
    task: str | None = None
    pooling_type: str | None = None        # sets seq_pooling_type or tok_pooling_type, whichever it names
    seq_pooling_type: str | None = None
    tok_pooling_type: str | None = None
    use_activation: bool | None = None     # normalize each vector to length 1
    dimensions: int | None = None          # the default of PoolingParams.dimensions
    logit_mean: float | None = None
    logit_sigma: float | None = None
    step_tag_id: int | None = None               # the defaults of PoolingParams' (STEP pooling)
    returned_token_ids: list[int] | None = None
    # vLLM's fields for its API server's chunking of over-long inputs: its offline calls, as ours, do not use them
    # (an over-long prompt is refused); checked, and logged as unused (Config)
    enable_chunked_processing: bool = False
    max_embed_len: int | None = None

    def __post_init__(self):
        check_task(self.task, "pooler_config.task")
        if not isinstance(self.enable_chunked_processing, bool):
            raise ValueError(f"pooler_config.enable_chunked_processing must be a bool, "
                             f"got {self.enable_chunked_processing!r:.80}.")
        if self.max_embed_len is not None and (isinstance(self.max_embed_len, bool)
                                               or not isinstance(self.max_embed_len, int) or self.max_embed_len < 1):
            raise ValueError(f"pooler_config.max_embed_len must be a positive int or None, "
                             f"got {self.max_embed_len!r:.80}.")
        check_step_parameters(self, "pooler_config.")
        for name in ("logit_mean", "logit_sigma"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"pooler_config.{name} must be a number or None, got {value!r:.80}.")
        if self.logit_sigma == 0:
            raise ValueError("pooler_config.logit_sigma must not be 0.")
        if self.pooling_type is not None:
            if self.seq_pooling_type is not None or self.tok_pooling_type is not None:
                raise ValueError("Cannot set both `pooling_type` and `seq_pooling_type` or `tok_pooling_type`.")
            if self.pooling_type in TOK_POOLING_TYPES:
                self.tok_pooling_type = self.pooling_type
            else:
                self.seq_pooling_type = self.pooling_type
        if self.seq_pooling_type not in (None, *SEQ_POOLING_TYPES):
            raise ValueError(f"seq_pooling_type must be one of {', '.join(SEQ_POOLING_TYPES)}, "
                             f"got {self.seq_pooling_type!r}.")
        if self.tok_pooling_type not in (None, *TOK_POOLING_TYPES):
            raise ValueError(f"tok_pooling_type must be one of {', '.join(TOK_POOLING_TYPES)}, "
                             f"got {self.tok_pooling_type!r}.")

    @classmethod
    def parse(cls, value) -> "PoolerConfig | None":
        """A PoolerConfig (copied: the engine fills in its unset fields), a dict of its fields, or None."""
        if value is None:
            return None
        if isinstance(value, cls):
            return copy.copy(value)
        if isinstance(value, dict):
            if "normalize" in value:
                raise ValueError("Parameter `normalize` was removed; use `use_activation` instead.")
            check_known_keys("pooler_config", value, sorted(f.name for f in fields(cls)))
            return cls(**value)
        raise ValueError(f"pooler_config must be a PoolerConfig or a dict of its fields, got {value!r:.80}.")

    def resolve(self, model_path: str):
        """Fill the unset pooling fields from the model's sentence-transformers files, then the defaults."""
        for name, value in sentence_transformers_pooling(model_path).items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        self.seq_pooling_type = self.seq_pooling_type or "LAST"
        self.tok_pooling_type = self.tok_pooling_type or "ALL"

    def reward_defaults(self, architectures: list[str]):
        """vLLM's defaults for a reward model (layers/classifier.py): a process reward model pools by STEP, at
        token 151651 (Qwen2.5-Math-PRM's step separator, "<extra_0>"); an outcome reward model gives its logits."""
        if "Qwen2ForProcessRewardModel" in architectures:
            self.tok_pooling_type = self.tok_pooling_type or "STEP"
            self.step_tag_id = 151651 if self.step_tag_id is None else self.step_tag_id
        elif self.use_activation is None:
            self.use_activation = False

    @property
    def needs_whole_prompts(self) -> bool:
        """Whether "embed" needs every token's hidden state of one pass over the whole prompt (CLS,
        MEAN), so that prompts are neither chunked nor read from the prefix cache (as in vLLM)."""
        return self.seq_pooling_type in ("CLS", "MEAN")


SENTENCE_TRANSFORMERS_MODULES = ("sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
                                 "sentence_transformers.models.Normalize")


def sentence_transformers_pooling(model_path: str) -> dict:
    """What a sentence-transformers model's modules.json and its Pooling module's config.json say
    (vLLM's get_pooling_config): {"seq_pooling_type": ..., "use_activation": (a Normalize module)};
    {} for other models."""
    modules_file = os.path.join(model_path, "modules.json")
    if not os.path.isfile(modules_file):
        return {}
    with open(modules_file, encoding="utf-8") as f:
        modules = json.load(f)
    types = [module.get("type") for module in modules]
    other = [t for t in types if t not in SENTENCE_TRANSFORMERS_MODULES]
    if other:   # (a Dense projection, say: leaving it out would give other vectors than the model's)
        raise ValueError(f"the sentence-transformers model in {model_path!r} has module(s) {other}; nanovllm runs "
                         f"{', '.join(SENTENCE_TRANSFORMERS_MODULES)} only.")
    result = {"use_activation": "sentence_transformers.models.Normalize" in types}
    pooling = next((module for module in modules if module.get("type") == "sentence_transformers.models.Pooling"),
                   None)
    pooling_file = pooling and os.path.join(model_path, pooling.get("path", ""), "config.json")
    if pooling_file and os.path.isfile(pooling_file):
        with open(pooling_file, encoding="utf-8") as f:
            for key, value in json.load(f).items():
                name = key.removeprefix("pooling_mode_").split("_", 1)[0].replace("lasttoken", "last").upper()
                if value is True and name in SEQ_POOLING_TYPES:
                    result["seq_pooling_type"] = name
    return result


def check_step_parameters(params, prefix: str = ""):
    """A ValueError unless params' step_tag_id is a token id (an int >= 0) or None, and its returned_token_ids a
    list of indices (ints >= 0) or None."""
    tag, columns = params.step_tag_id, params.returned_token_ids
    if tag is not None and (isinstance(tag, bool) or not isinstance(tag, int) or tag < 0):
        raise ValueError(f"{prefix}step_tag_id must be a token id (an int >= 0) or None, got {tag!r:.80}.")
    if columns is not None and not (isinstance(columns, (list, tuple)) and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in columns)):
        raise ValueError(f"{prefix}returned_token_ids must be a list of ints >= 0 or None, got {columns!r:.80}.")


def is_sentence_transformers_model(model_path: str) -> bool:
    return os.path.isfile(os.path.join(model_path, "modules.json"))


@dataclass
class PoolingParams:
    """vLLM's PoolingParams: what one pooling request asks for.
    use_activation: embeddings scaled to length 1, a classifier's logits made probabilities (None: the
    engine's pooler_config, else True). dimensions: keep an embedding's first N features (a Matryoshka
    model's; None: all)."""
    use_activation: bool | None = None
    dimensions: int | None = None
    step_tag_id: int | None = None           # STEP pooling's (see above; None: the engine's pooler_config)
    returned_token_ids: list[int] | None = None
    task: str | None = None                  # one of POOLING_TASKS; LLM.embed / classify / encode set it
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    def __post_init__(self):
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(f"use_activation must be a bool or None, got {self.use_activation!r:.80}.")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)):
            raise ValueError(f"dimensions must be an int or None, got {self.dimensions!r:.80}.")
        check_step_parameters(self)
        check_task(self.task, "task")

    def clone(self) -> "PoolingParams":
        return PoolingParams(**{f.name: getattr(self, f.name) for f in fields(self)})

    def resolved(self, task: str, pooler: PoolerConfig, model_config) -> "PoolingParams":
        """A copy for one request of task: the pooler_config's defaults filled in, and its fields
        checked as vLLM checks them against the model (model_config.py's ModelConfig; a ValueError
        naming the field or the model)."""
        params = self.clone()
        if params.task is not None and params.task != task:
            raise ValueError(f"You cannot overwrite params.task={params.task!r} with pooling_task={task!r}!")
        params.task = task
        if params.use_activation is None:
            params.use_activation = True if pooler.use_activation is None else pooler.use_activation
        params.resolve_step_pooling(pooler, model_config)
        if task in CLASSIFY_TASKS:
            if params.dimensions is not None:
                raise ValueError(f"Task {task!r} only supports {TASK_PARAMETERS[task]} parameters, does not "
                                 f"support ['dimensions'] parameters")
            return params
        if params.dimensions is None:
            params.dimensions = pooler.dimensions
        if params.dimensions is not None:
            model_name, size = model_config.served_model_name, model_config.embedding_size
            matryoshka = model_config.matryoshka_dimensions
            if not model_config.is_matryoshka:
                raise ValueError(f"Model {model_name!r} does not support Matryoshka embeddings; dimensions must "
                                 f"be unset (received dimensions={params.dimensions}).")
            if not 1 <= params.dimensions <= size:
                raise ValueError(f"Model {model_name!r} only supports dimensions in range [1, {size}], "
                                 f"got {params.dimensions}.")
            if matryoshka and params.dimensions not in matryoshka:
                raise ValueError(f"Model {model_name!r} only supports Matryoshka dimensions {matryoshka}, "
                                 f"got {params.dimensions}.")
        return params

    def resolve_step_pooling(self, pooler: PoolerConfig, model_config):
        """STEP pooling's parameters: the pooler_config's where unset; refused (vLLM's words) unless the engine
        pools by STEP; the columns checked against the width of a token's result."""
        if pooler.tok_pooling_type != "STEP":
            invalid = [name for name in STEP_PARAMETERS if getattr(self, name) is not None]
            if invalid:
                raise ValueError(f"Task {self.task} only supports {TASK_PARAMETERS[self.task]} parameters, "
                                 f"does not support {invalid} parameters")
            return
        for name in STEP_PARAMETERS:
            if getattr(self, name) is None:
                setattr(self, name, getattr(pooler, name))
        if self.returned_token_ids is not None and self.task in TOKEN_TASKS:
            classifier = model_config.classifier
            width = classifier.num_labels if classifier is not None else model_config.embedding_size
            outside = [i for i in self.returned_token_ids if i >= width]
            if outside:
                what = "labels" if classifier is not None else "features"
                raise ValueError(f"returned_token_ids {outside} are past the {width} {what} of a token's result.")
            self.returned_token_ids = list(self.returned_token_ids)
