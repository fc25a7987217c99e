"""flamia_pack.scheduler (see DESIGN.md §2)."""
