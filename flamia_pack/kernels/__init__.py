"""flamia_pack.kernels (see DESIGN.md §2)."""
