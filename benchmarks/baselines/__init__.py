"""What users would run instead of our kernels (transformers, PEFT, Liger), behind our call signatures."""
