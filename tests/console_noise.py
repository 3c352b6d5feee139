"""Library chatter a user must not see when a job launches or exports (issue #28): each line -> where it came from.

Shared by tests/pipelines/test_demo.py, tests/test_examples.py and the export test of tests/pipelines/test_engine.py."""

NOISE = {
    "Setting accelerator to CPU": "DeepSpeed's accelerator auto-detection (DS_ACCELERATOR unset)",
    "built successfully": "DeepSpeed's print() when it loads its CPU shared-memory collectives",
    "all_gather_into_tensor` is deprecated": "torch 2.13 FutureWarning on DeepSpeed's collective",
    "OMP_NUM_THREADS/MKL_NUM_THREADS unset": "accelerate replacing the thread count of a CPU process",
    "Gradient accumulation steps mismatch": "accelerate's default of 1 against DeepSpeed's accumulation (engines.build_engine)",
    "Detected checkpoint of type zero stage": "DeepSpeed's print() when export consolidates a ZeRO checkpoint",
    "Reconstructed fp32 state dict": "the same consolidation's print()",
    "Loading checkpoint shards": "the same consolidation's tqdm bar over the optimizer-state files",
    "Writing model shards": "transformers' save_pretrained bar, for the release's one file",
}
