"""The fine-tuning configuration (``FinetuneConfig``) and the task registry (``FINETUNE_TASKS``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from core.config import ConfigError, option
from pipelines.engine.config import (
    DistributedConfig,
    LoggingConfig,
    OptimConfig,
    ScheduleConfig,
    TrainConfig,
    check_at_least,
)


@dataclass(kw_only=True)
class FinetuneDataConfig:
    """Labelled examples read from local files."""

    train: str = option("", help="Training examples: .tsv, .csv or .jsonl (classification), SQuAD .json (qa), or a "
                                 "folder of one sub-folder of images per class (image_classification).")
    validation: str = option("", help="Dev examples in the same format; selects the best epoch.")
    text_column: str = option("text", help="Column holding the (first) text.")
    text_pair_column: str = option("", help="Column holding the second text of a pair task (empty = single text).")
    label_column: str = option("label", help="Column holding the label name (or a number for regression).")
    regression: bool = option(False, help="Numeric labels, one output (num_labels = 1), MSE loss.")
    max_seq_len: int = option(128, help="Tokens per example after truncation (longest side first for pairs).")
    micro_batch_size: int = option(32, help="Examples per process per forward pass.")
    max_bad_share: float = option(0.01, help="Fail when more than this share of a file's rows is bad.")
    num_workers: int | None = option(
        None, help="Processes per rank that decode and preprocess images (image_classification): the training and "
                   "evaluation batches and the check of every image before training (0 = in the main process). "
                   "Unset: 2 for image_classification, 0 for the text tasks (whose examples are tokenized before "
                   "training, so a worker would only add its start-up).")

    def __post_init__(self) -> None:
        check_at_least("data", self, 1, "max_seq_len", "micro_batch_size")
        if self.num_workers is not None and self.num_workers < 0:
            raise ConfigError(f"data.num_workers must be >= 0 (0 = in the main process), got {self.num_workers}.")


@dataclass(kw_only=True)
class QAConfig:
    """Extractive question answering (SQuAD v1.1 / v2.0 JSON)."""

    version_2: bool = option(False, help="SQuAD v2.0: questions may be unanswerable (null answer allowed).")
    doc_stride: int = option(64, help="Overlap in tokens between consecutive windows over a long context.")
    max_query_len: int = option(64, help="Question tokens kept (truncated beyond).")
    max_answer_len: int = option(30, help="Longest answer span, in tokens, considered when decoding.")
    n_best: int = option(20, help="Start/end candidates considered per window when decoding.")
    null_score_threshold: float = option(0.0, help="v2: predict no answer when null score - best span score > this.")

    def __post_init__(self) -> None:
        check_at_least("qa", self, 1, "doc_stride", "max_query_len", "max_answer_len", "n_best")


@dataclass(kw_only=True)
class AugmentConfig:
    """Training-only augmentation of image_classification, on the decoded image before the release's processor
    (evaluation and the release see the processor's view alone)."""

    min_crop_area: float = option(0.8, help="Random crop of at least this share of the image (aspect 3/4..4/3); 1 = off.")
    hflip: bool = option(True, help="Mirror half the training images; off when a mirror is another class (digits, text).")

    def __post_init__(self) -> None:
        if not 0.0 < self.min_crop_area <= 1.0:
            raise ConfigError(f"augment.min_crop_area must be in (0, 1] (1 = no random crop), got {self.min_crop_area}.")


@dataclass(kw_only=True)
class FinetuneConfig:
    """A fine-tuning run; saved as run_dir/config.yaml like a pretraining run."""

    checkpoint: str = option("", help="Release directory (config.json + weights + tokenizer) or a run checkpoint.")
    init: Literal["pretrained", "random"] = option(
        "pretrained", help="random = the same architecture from scratch (a baseline for the pretrained weights)."
    )
    epochs: int = option(3, help="Passes over the training set; sets train.max_steps.")
    early_stopping_patience: int = option(0, help="Stop after this many epochs without a better dev metric (0 = off).")
    selection_metric: str = option("accuracy", help="Dev metric that picks the best epoch (accuracy, macro_f1, mcc, pearson…).")
    data: FinetuneDataConfig = option(help="Data.", default_factory=FinetuneDataConfig)
    qa: QAConfig = option(help="QA decoding (train.task=qa).", default_factory=QAConfig)
    augment: AugmentConfig = option(help="Image augmentation (train.task=image_classification).", default_factory=AugmentConfig)
    optim: OptimConfig = option(help="Optimizer.", default_factory=lambda: OptimConfig(lr=1e-4, weight_decay=0.01))
    schedule: ScheduleConfig = option(
        help="LR schedule.", default_factory=lambda: ScheduleConfig(warmup="linear", warmup_steps=10, decay="linear")
    )
    train: TrainConfig = option(
        help="Training loop (max_steps comes from epochs).",
        default_factory=lambda: TrainConfig(task="classification", run_dir="runs/finetune", resume="auto"),
    )
    distributed: DistributedConfig = option(
        help="Distribution.", default_factory=lambda: DistributedConfig(engine="ddp", zero_stage=0)
    )
    logging: LoggingConfig = option(help="Logging.", default_factory=lambda: LoggingConfig(tensorboard=True))

    def __post_init__(self) -> None:
        if self.train.task not in FINETUNE_TASKS:
            raise ConfigError(f"train.task must be one of {', '.join(FINETUNE_TASKS)} for fine-tuning, got {self.train.task!r}.")
        if self.epochs < 1:
            raise ConfigError(f"epochs must be >= 1, got {self.epochs}.")
        if self.early_stopping_patience < 0:
            raise ConfigError(f"early_stopping_patience must be >= 0 (0 = off), got {self.early_stopping_patience}.")
        if self.data.num_workers and self.train.task not in IMAGE_TASKS:
            raise ConfigError(f"data.num_workers={self.data.num_workers}: train.task={self.train.task} tokenizes every "
                              f"example before training, so its batches are made in the main process (workers would "
                              f"only add their start-up). Remove data.num_workers; it applies to image_classification.")

    @property
    def loader_workers(self) -> int:
        """``data.num_workers``, or the task's default where unset. Images: 2, pretraining's loader default: the
        next batches are decoded and processed beside the step and off the training process (1.2-1.4x images/s on
        the 2-core VM with a core free, benchmarks/finetune_image_loading.py), while a laptop is not flooded with
        processes; a GPU host raises it (a worker made ~200 images/s of 224 px batches from JPEGs here). Text: 0, its
        batches are lists of token ids padded in a few microseconds: workers would only add their start-up."""
        if self.data.num_workers is not None:
            return self.data.num_workers
        return 2 if self.train.task in IMAGE_TASKS else 0


#: The tasks whose batches are decoded from files as they are read (``data.num_workers`` applies to them).
IMAGE_TASKS = ("image_classification",)

#: train.task -> "module:function" running that kind of fine-tuning (imported on use).
FINETUNE_TASKS = {
    "classification": "pipelines.finetune.classification:finetune_classification",
    "qa": "pipelines.finetune.qa:finetune_qa",
    "image_classification": "pipelines.finetune.image_classification:finetune_image_classification",
}
