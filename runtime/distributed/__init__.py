"""Distributed concerns of a training run, one module each: process group and watchdog, mesh, expert
parallelism, context parallelism, activation checkpointing, compile, FSDP2, gathering of sharded state; and
parallelize.py, the one recipe that applies them to a model in order."""
