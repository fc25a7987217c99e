"""The ``flamia`` command line (typer + rich).

Sub-commands (each owned by the module named beside it; this file only wires them):

- ``flamia pack``       pack a dataset into row buffers           (pack.py, formats.py, loaders/sources.py)
- ``flamia plan``       work list, policy and predicted time       (scheduler/)
- ``flamia probe-leak`` causal leak probe of an attention path     (kernels/leak.py)
- ``flamia bench``      attention benchmark on the local GPU       (benchmarks/, kernels/)
- ``flamia serve``      the FastAPI cost-prediction service        (service/)

Errors in user input are reported as one red line on stderr and a non-zero exit code
(``FlamiaError`` subclasses), never a traceback.
"""
from __future__ import annotations

import typer

app = typer.Typer(
    name="flamia",
    help="flamia_pack: packed variable-length documents for long-context training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# ---- pack (issue: packing) -------------------------------------------------------------------
# (section owned by the packing work; replaced by the real command)

# ---- plan (issue: work list / scheduler) -----------------------------------------------------
# (section owned by the scheduler work)

# ---- probe-leak (issue: quantizer / leak probe) ----------------------------------------------
# (section owned by the quantizer work)

# ---- bench (issue: kernels) -------------------------------------------------------------------
# (section owned by the kernel work)

# ---- serve (issue: service) -------------------------------------------------------------------
# (section owned by the service work)


def main() -> None:
    """Console-script entry point for ``flamia``."""
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
