"""flamia_pack.loaders (see DESIGN.md §2)."""
