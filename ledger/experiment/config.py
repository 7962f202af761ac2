"""The experiment configuration: a tree of dataclasses with defaults, loaded from TOML (``tomllib``).

Loading is strict: an unknown section or key, or a value of the wrong type, raises :class:`InputError` naming the
dotted key, so a typo never silently falls back to a default. ``to_json()`` gives the canonical-JSON form that
prepare stores as the ``config`` artifact (its digest is committed by the ``prepared`` digest); integers given for
float settings are stored as floats, so ``lr = 1`` and ``lr = 1.0`` are the same config.

Paths (work directory, ledger URL) are deliberately not part of the config artifact: the same experiment prepared in
two places has the same digests. Where and how an experiment is launched (torchrun across hosts, NCCL, a PostgreSQL
ledger) may still be written in the same TOML file, as the ``[launch]`` table: it is parsed and validated as
strictly as the rest, but left out of ``to_json()`` and of equality.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

from ledger import digests
from ledger.errors import InputError
from ledger.experiment.arms import ARMS as ARMS  # the arms' own module; re-exported for the runners
from ledger.experiment.arms import Arm as Arm

CONFIG_FORMAT: Final = "ledger-experiment-config"
CONFIG_VERSION: Final = 1



def single_rank_arm() -> str:
    """The arm that trains on one rank: the reference every distributed arm's time is compared with."""
    return next(a.name for a in ARMS.values() if a.world == 1)



@dataclass(frozen=True)
class DataConfig:
    """Task documents (see runners/tasks.py) and retention probes."""

    train_per_variant: int = 512  # training documents per (family, variant)
    eval_per_variant: int = 64  # held-out selection documents per (family, variant): 4 x 4 x 64 = 1,024
    retention_probes: int = 128  # pydoc windows of the seed's pretraining stream, re-scored after training


DTYPES: Final = ("float32", "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    """A model spec: ``tiny`` is runners/model.py's transformer with a character tokenizer built from the data;
    ``hf`` a Hugging Face causal LM in the local directory ``path`` (its ``config.json``, its weights if present,
    and its ``tokenizer.json``). The sizes below (``d_model`` .. ``init_std``) describe ``tiny`` only; ``max_len``
    bounds the sequences of either kind."""

    kind: str = "tiny"
    path: str = ""  # local directory, only for kind = "hf"
    dtype: str = "float32"  # parameter dtype: "float32" or "bfloat16" (the bits of every state depend on it)
    # 64 wide, not 128: on 2 cores a step costs a third as much, and 1,600 steps of the small model learn far more
    # than 640 of the large one (docs/training.md, section 8).
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    max_len: int = 128
    tie_embeddings: bool = False  # tied weights share storage, which safetensors refuses to save twice
    dropout: float = 0.0  # if > 0, masks come from an explicit generator (runners/model.py)
    init_std: float = 0.02


@dataclass(frozen=True)
class PretrainConfig:
    """The seed model's short pretraining on ``pydoc_data.topics`` plus a little task-format text.

    The stream is every pydoc topic and the first ``task_documents`` training documents, each framed as
    ``BOS text EOS``, so the seed learns where a document ends (exact match needs the EOS) and has seen the task
    format without having been trained on it; windows of ``seq_len + 1`` tokens are drawn from it at random.
    """

    steps: int = 1200
    batch_size: int = 32
    seq_len: int = 64  # window length in tokens (characters for ``tiny``); a probe is one window plus its target
    task_documents: int = 2048  # training documents (in their seeded order) added to the pretraining stream
    lr: float = 0.005
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # 0 disables clipping
    threads: int = 1  # intra-op threads: the count changes float results, so it is pinned and recorded


@dataclass(frozen=True)
class DilocoConfig:
    # H = 10: the most outer steps (160) the efficiency contract allows (a tenth of DDP's bytes); H = 16 lost 7
    # points more. Nesterov lr 0.6 and momentum 0.7: a steady-state step of twice the pseudo-gradient but a first
    # response of about one, where 1.0/0.5 or 1.2/0.5 overshot (docs/training.md, section 8).
    inner_steps: int = 10  # H: inner AdamW steps between outer synchronisations
    outer_lr: float = 0.6
    outer_momentum: float = 0.7
    nesterov: bool = True


@dataclass(frozen=True)
class TrainConfig:
    """Settings shared by the three arms (same data, same global batch)."""

    steps: int = 1600  # a multiple of diloco.inner_steps, so DiLoCo ends on an outer step
    global_batch: int = 32  # documents per step over all ranks
    world: int = 4  # ranks of the distributed arms
    lr: float = 0.004
    warmup_steps: int = 20
    schedule: str = "cosine"  # "cosine": linear warm-up, cosine decay to min_lr_ratio * lr; "constant"
    min_lr_ratio: float = 0.02
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    checkpoint_every: int = 160  # a multiple of H too: every checkpoint is on an outer-step boundary
    threads_per_rank: int = 1
    loss_on: str = "answer"  # "answer": loss on answer + EOS tokens only; "all": every token of the document
    # Pretraining windows mixed into every step, as a fraction of the global batch (the same for every arm): each
    # window's mean token NLL joins the documents' sum, so fine-tuning keeps the seed's language model.
    # 0.5 (16 windows, 4 per rank) at weight 2 keeps the retention change near 0; 0.25 left +0.09 nats/token.
    pretrain_mix: float = 0.5
    # A mixed window is pretrain_window + 1 tokens, the length of the seed's windows and of its retention probes
    # (shorter windows do not keep the longer contexts the probes score).
    pretrain_window: int = 64
    pretrain_weight: float = 2.0  # each window's mean token NLL counts as this many documents' losses
    diloco: DilocoConfig = field(default_factory=DilocoConfig)

    @property
    def pretrain_windows(self) -> int:
        """Pretraining windows per step over all ranks (``pretrain_mix * global_batch``, validated whole)."""
        return int(self.pretrain_mix * self.global_batch)


@dataclass(frozen=True)
class EvalConfig:
    max_new_tokens: int = 16
    batch_size: int = 64


@dataclass(frozen=True)
class QualityContract:
    """Pre-registered quality thresholds (the reference report's learning ``conditions``)."""

    minimum_accuracy_gain_vs_seed: float = 0.1  # every arm's exact-match gain over the seed is at least this
    maximum_one_sided_p_vs_seed: float = 0.01  # exact one-sided binomial p on discordant pairs is at most this
    # Primary arm vs DDP: 99% paired lower bound at least this. -0.15, not the reference's -0.05, set before the
    # measured runs: in tuning at this size DiLoCo (1/10 of DDP's bytes) landed 6 to 10 points below DDP, a paired
    # 99% bound near -0.12 (docs/training.md, section 8); a broken outer step lands 60 points below.
    paired_99pct_lower_vs_ddp_min: float = -0.15
    retention_99pct_upper_max: float = 0.05  # mean per-probe loss change (nats/token): 99% upper at most this


@dataclass(frozen=True)
class EfficiencyContract:
    """Pre-registered efficiency thresholds (the reference report's training ``conditions``)."""

    active_seconds_vs_ddp_max: float = 1.0  # primary arm's max-rank active seconds / DDP's
    sent_bytes_vs_ddp_max: float = 0.1  # primary arm's total sent bytes / DDP's


@dataclass(frozen=True)
class ServingContract:
    """Pre-registered serving conditions (the reference report's serving ``conditions``)."""

    all_requests_completed: bool = True
    identical_successful_output_tokens: bool = True
    no_cache_hits: bool = True


@dataclass(frozen=True)
class ContractConfig:
    primary_arm: str = "diloco-four"
    baseline_arm: str = "ddp-four"
    quality: QualityContract = field(default_factory=QualityContract)
    efficiency: EfficiencyContract = field(default_factory=EfficiencyContract)
    serving: ServingContract = field(default_factory=ServingContract)


LAUNCHERS: Final = ("local", "torchrun")
DEVICES: Final = ("cpu", "cuda")
CUBLAS_WORKSPACE_CONFIGS: Final = (":4096:8", ":16:8")  # the two settings that make cuBLAS deterministic


@dataclass(frozen=True)
class LaunchConfig:
    """Where and how the ranks run: not part of the experiment (never in the config artifact or its digest), so
    the same experiment launched on other hosts or against another ledger keeps its ``prepared`` digest.

    ``local`` is ``ledger run``'s own launcher on one host; ``torchrun`` is one ``torchrun`` per host, which
    :meth:`torchrun_command` spells out. On ``cuda`` every rank uses NCCL and needs ``cublas_workspace_config``
    for deterministic cuBLAS (docs/training.md, "On CUDA").
    """

    launcher: str = "local"
    device: str = "cpu"
    nnodes: int = 1
    nproc_per_node: int = 4
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    db: str = ""  # SQLAlchemy URL every rank appends to; "" = <workdir>/ledger.db
    artifacts: str = ""  # the artifact directory when db is not an SQLite file beside it
    workdir: str = ""  # the prepared work directory, at the same path on every host
    cublas_workspace_config: str = ""

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    def torchrun_command(self, node_rank: int, arm: str, run: str) -> str:
        """The shell command that starts host ``node_rank``'s ranks of ``arm`` under torchrun."""
        if self.launcher != "torchrun":
            raise InputError(f"launch.launcher is {self.launcher!r}, not 'torchrun'")
        if not 0 <= node_rank < self.nnodes:
            raise InputError(f"node rank {node_rank} is not in [0, launch.nnodes={self.nnodes})")
        env = [f"CUBLAS_WORKSPACE_CONFIG={self.cublas_workspace_config}"] if self.cublas_workspace_config else []
        env += [f"LEDGER_DB={self.db}"] + ([f"LEDGER_ARTIFACTS={self.artifacts}"] if self.artifacts else [])
        # --run-name: torchrun's parser takes --run for an abbreviation of its own --run-path.
        return " ".join([*env, "torchrun", f"--nnodes {self.nnodes}", f"--nproc-per-node {self.nproc_per_node}",
                         f"--node-rank {node_rank}", f"--master-addr {self.master_addr}",
                         f"--master-port {self.master_port}", "-m runners.train", f"--workdir {self.workdir}",
                         f"--db {self.db}", f"--arm {arm}", f"--run-name {run}"])


@dataclass(frozen=True)
class ExperimentConfig:
    """The whole experiment. Every tunable lives here; the canonical JSON of this tree is the config artifact."""

    name: str = "four-families"
    seed: int = 1234
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    contract: ContractConfig = field(default_factory=ContractConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig, compare=False)  # not part of the experiment

    def to_json(self) -> dict[str, Any]:
        """The canonical-JSON-able form (a format tag, a version, and every setting but ``launch``)."""
        body = dataclasses.asdict(self)
        del body["launch"]
        return {"format": CONFIG_FORMAT, "version": CONFIG_VERSION, "config": body}

    def canonical_bytes(self) -> bytes:
        return digests.canonical_bytes(self.to_json())

    def digest(self) -> str:
        """The config artifact's digest (plain BLAKE3 of its canonical bytes, as the artifact store names it)."""
        return digests.raw_digest(self.canonical_bytes())


# ------------------------------------------------------------------------------------------------ loading

T = TypeVar("T")


def _build(cls: type[T], values: Any, where: str) -> T:
    """Build dataclass ``cls`` from a TOML table, checking keys and types."""
    if not isinstance(values, dict):
        raise InputError(f"config {where or 'root'}: expected a table, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - known)
    if unknown:
        raise InputError(f"config: unknown key {_join(where, unknown[0])!r} (known: {', '.join(sorted(known))})")
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        kwargs[name] = _coerce(hints[name], value, _join(where, name))
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, where: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)  # type: ignore[arg-type]
    # bool is an int subclass: check it first and never accept it for a number (nor a number for it)
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - guards new field types added without updating this function
        raise TypeError(f"config field {where} has unsupported type {hint!r}")
    raise InputError(f"config: {where} must be {hint.__name__}, got {type(value).__name__} {value!r}")


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


# Bounds no sensible run comes near: past them a config describes tensors this code cannot allocate (beyond 2**63
# elements, or terabytes) or documents it cannot hold, which would otherwise end in an allocator's traceback or in
# a prepare step that never finishes.
MAX_TINY_PARAMETERS: Final = 2**32  # the tiny kind is for CPU-sized models; a large one is kind = "hf"
TINY_VOCAB_BOUND: Final = 1024  # the character tokenizer's vocabulary stays below this (for the estimate)
MAX_LEN: Final = 2**20  # tokens of a sequence
MAX_PER_VARIANT: Final = 2**20  # documents of each (family, variant), and retention probes
MAX_BATCH: Final = 2**16  # documents or windows of one step or one evaluation batch


def tiny_parameters(m: ModelConfig, vocab: int = TINY_VOCAB_BOUND) -> int:
    """The parameters of runners/model.py's TinyLM of ``m`` with a vocabulary of ``vocab`` tokens."""
    d, f = m.d_model, m.d_ff
    block = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d  # qkv + proj, fc + out, two layer norms
    return vocab * d * (1 if m.tie_embeddings else 2) + m.max_len * d + m.n_layers * block + 2 * d


def validate(config: ExperimentConfig) -> ExperimentConfig:
    """Reject settings that are well-typed but meaningless or beyond the bounds above; returns ``config``."""
    m, p, t = config.model, config.pretrain, config.train
    windows = t.pretrain_mix * t.global_batch
    train_documents = 16 * config.data.train_per_variant  # 4 families x 4 variants
    checks: list[tuple[bool, str]] = [
        (m.kind in ("tiny", "hf"), f"model.kind must be 'tiny' or 'hf', got {m.kind!r}"),
        (m.kind != "hf" or bool(m.path), "model.path is required when model.kind = 'hf'"),
        (m.dtype in DTYPES, f"model.dtype must be one of {', '.join(DTYPES)}, got {m.dtype!r}"),
        (m.d_model > 0 and m.n_heads > 0 and m.d_model % m.n_heads == 0,
         f"model.d_model ({m.d_model}) must be a positive multiple of model.n_heads ({m.n_heads})"),
        (m.n_layers > 0 and m.d_ff > 0, "model.n_layers and model.d_ff must be positive"),
        (0.0 <= m.dropout < 1.0, f"model.dropout must be in [0, 1), got {m.dropout}"),
        (m.init_std > 0, "model.init_std must be positive"),
        (0 < p.seq_len <= m.max_len, f"pretrain.seq_len ({p.seq_len}) must be in [1, model.max_len={m.max_len}]"),
        (p.steps >= 0 and p.batch_size > 0 and p.threads > 0,
         "pretrain.steps >= 0, pretrain.batch_size > 0, pretrain.threads > 0"),
        (config.data.train_per_variant > 0 and config.data.eval_per_variant > 0,
         "data.train_per_variant and data.eval_per_variant must be positive"),
        (config.data.retention_probes >= 0, "data.retention_probes must be >= 0"),
        (0 <= p.task_documents <= train_documents,
         f"pretrain.task_documents ({p.task_documents}) must be in [0, {train_documents}] (the training documents)"),
        (t.lr >= 0 and p.lr >= 0, "train.lr and pretrain.lr must be >= 0 (0 trains nothing: the negative tests)"),
        (t.pretrain_mix >= 0 and windows == int(windows) and int(windows) % t.world == 0,
         f"train.pretrain_mix ({t.pretrain_mix}) x train.global_batch ({t.global_batch}) must be a whole number of "
         f"windows and a multiple of train.world ({t.world})"),
        (t.steps > 0 and t.world > 0 and t.global_batch > 0 and t.global_batch % t.world == 0,
         f"train.global_batch ({t.global_batch}) must be a positive multiple of train.world ({t.world})"),
        (t.checkpoint_every > 0 and t.threads_per_rank > 0, "train.checkpoint_every, threads_per_rank > 0"),
        (t.loss_on in ("answer", "all"), f"train.loss_on must be 'answer' or 'all', got {t.loss_on!r}"),
        (t.schedule in ("cosine", "constant"), f"train.schedule must be 'cosine' or 'constant', got {t.schedule!r}"),
        (t.pretrain_weight >= 0, f"train.pretrain_weight must be >= 0, got {t.pretrain_weight}"),
        (t.pretrain_mix == 0 or 0 < t.pretrain_window <= m.max_len,
         f"train.pretrain_window ({t.pretrain_window}) must be in [1, model.max_len={m.max_len}]"),
        (t.diloco.inner_steps > 0, "train.diloco.inner_steps must be positive"),
        (t.diloco.outer_lr >= 0 and 0 <= t.diloco.outer_momentum < 1,
         "train.diloco.outer_lr must be >= 0 and train.diloco.outer_momentum in [0, 1)"),
        (config.contract.primary_arm in ARMS and config.contract.baseline_arm in ARMS,
         f"contract.primary_arm and contract.baseline_arm must be among {', '.join(ARMS)}"),
        (config.eval.max_new_tokens > 0 and config.eval.batch_size > 0, "eval settings must be positive"),
        (m.max_len <= MAX_LEN, f"model.max_len ({m.max_len}) must be at most {MAX_LEN:,}"),
        (m.kind != "tiny" or tiny_parameters(m) <= MAX_TINY_PARAMETERS,
         f"model.d_model, n_layers, d_ff and max_len describe {tiny_parameters(m):,} parameters, more than the "
         f"{MAX_TINY_PARAMETERS:,} a tiny model may have (a large model is kind = 'hf')"),
        (max(config.data.train_per_variant, config.data.eval_per_variant,
             config.data.retention_probes) <= MAX_PER_VARIANT,
         f"data.train_per_variant, eval_per_variant and retention_probes must be at most {MAX_PER_VARIANT:,}"),
        (max(p.batch_size, t.global_batch, config.eval.batch_size) <= MAX_BATCH,
         f"pretrain.batch_size, train.global_batch and eval.batch_size must be at most {MAX_BATCH:,}"),
        (config.eval.max_new_tokens <= MAX_LEN, f"eval.max_new_tokens must be at most {MAX_LEN:,}"),
    ]
    checks += _launch_checks(config.launch, t.world)
    for ok, message in checks:
        if not ok:
            raise InputError(f"config: {message}")
    return config


def _launch_checks(la: LaunchConfig, world: int) -> list[tuple[bool, str]]:
    checks = [
        (la.launcher in LAUNCHERS, f"launch.launcher must be one of {', '.join(LAUNCHERS)}, got {la.launcher!r}"),
        (la.device in DEVICES, f"launch.device must be one of {', '.join(DEVICES)}, got {la.device!r}"),
        (la.nnodes > 0 and la.nproc_per_node > 0, "launch.nnodes and launch.nproc_per_node must be positive"),
        (la.launcher != "torchrun" or la.nnodes * la.nproc_per_node == world,
         f"launch.nnodes x launch.nproc_per_node ({la.nnodes} x {la.nproc_per_node}) must equal train.world "
         f"({world}) under torchrun"),
        (0 < la.master_port < 65536, f"launch.master_port must be a TCP port, got {la.master_port}"),
        (la.cublas_workspace_config in ("", *CUBLAS_WORKSPACE_CONFIGS),
         f"launch.cublas_workspace_config must be one of {', '.join(CUBLAS_WORKSPACE_CONFIGS)} or empty"),
        (la.device != "cuda" or bool(la.cublas_workspace_config),
         "launch.cublas_workspace_config is required on cuda: deterministic cuBLAS needs it"),
        (la.launcher != "torchrun" or bool(la.db and la.workdir),
         "launch.db and launch.workdir are required under torchrun: every host's ranks append to one ledger"),
    ]
    if la.db:
        checks.append(_url_check(la.db, la.nnodes))
    return checks


def _url_check(url: str, nnodes: int) -> tuple[bool, str]:
    """A SQLAlchemy URL the store can open; many hosts need a server database (SQLite is one host's file)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        backend = make_url(url).get_backend_name()
    except ArgumentError:
        return False, f"launch.db is not a database URL: {url!r}"
    if backend not in ("sqlite", "postgresql"):
        return False, f"launch.db must be an sqlite or postgresql URL, got {backend!r}"
    return (backend != "sqlite" or nnodes == 1,
            f"launch.db is an SQLite file but launch.nnodes = {nnodes}: ranks on several hosts need PostgreSQL")


def config_from_dict(values: dict[str, Any]) -> ExperimentConfig:
    """Build and validate a config from a (TOML-shaped) mapping; missing keys take their defaults."""
    return validate(_build(ExperimentConfig, values, ""))


MAX_CONFIG_BYTES: Final = 1 << 20  # examples/experiment.toml is 3 KB


def load_config(path: Path | None) -> ExperimentConfig:
    """Load a TOML config file; ``None`` gives the defaults (which equal examples/experiment.toml)."""
    if path is None:
        return validate(ExperimentConfig())
    try:
        data = digests.read_regular(path, max_bytes=MAX_CONFIG_BYTES)  # not a FIFO, a device or /dev/zero's endless
    except FileNotFoundError as exc:
        raise InputError(f"config file {path} does not exist") from exc
    try:
        values = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InputError(f"config file {path} is not UTF-8 text (byte {exc.start}), so not TOML") from exc
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"config file {path} is not valid TOML: {exc}") from exc
    return config_from_dict(values)


def config_from_json(document: Any) -> ExperimentConfig:
    """Rebuild a config from its ``to_json()`` form (e.g. the parsed config artifact)."""
    if not isinstance(document, dict) or document.get("format") != CONFIG_FORMAT:
        raise InputError(f"not a {CONFIG_FORMAT} document")
    if document.get("version") != CONFIG_VERSION:
        raise InputError(f"config version {document.get('version')!r}, this code reads {CONFIG_VERSION}")
    config = config_from_dict(document["config"])
    # Compare bytes, not values: 1 == 1.0 in Python, but an integer where a float belongs is another artifact.
    if digests.canonical_bytes(config.to_json()) != digests.canonical_bytes(document):
        raise InputError("config document does not round-trip (missing, defaulted or mistyped keys)")
    return config


def config_from_bytes(data: bytes) -> ExperimentConfig:
    """Parse the canonical config artifact bytes."""
    return config_from_json(digests.parse_canonical(data))
