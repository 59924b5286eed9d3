"""Distributed concerns of a training run, one module each: process group and watchdog, mesh, expert
parallelism, activation checkpointing, compile, FSDP2, and gathering of sharded state."""
