"""flamia_pack.service (see DESIGN.md §2)."""
