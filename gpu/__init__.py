"""Bottom of the package graph: plumbing shared by the kernel packages (registries of named
implementations, Triton launch helpers, device properties). Imports nothing of ours."""
