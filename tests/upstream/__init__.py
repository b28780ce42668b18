"""A harness that runs PyTorch's own FSDP2 tests (kept outside the repository) stock and with TIDE enabled
process-wide, and records each test's outcome in both modes and TIDE's path counts (docs/fsdp.md,
"PyTorch's FSDP2 tests")."""
