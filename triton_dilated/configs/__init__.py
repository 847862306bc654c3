"""Tuned launch configs, data only: <arch>.json per GPU architecture, written by
`python -m triton_dilated.perf tune` and read by triton_dilated.ops.common.configs."""
