"""flamia_pack.scheduler: work lists, cost model, schedule simulator, policy (DESIGN.md §6).

- :mod:`.worklist`  item table, host reference, numba builder, GPU builder, snake assignment
- :mod:`.cost`      the one visible-pairs / FLOPs / tile-count function set
- :mod:`.policy`    static vs dynamic rule
- :mod:`.simulate`  calibration table, schedule simulator, :func:`predict`
- :mod:`.workloads` WORKLOADS.md length mixes and the lognormal generator
- :mod:`.mix`       pack a length mix into rows (BFD), then predict it (shared by `flamia plan` and the service)
"""
from flamia_pack.scheduler.cost import attention_flops, tile_count, visible_pairs
from flamia_pack.scheduler.policy import choose_policy
from flamia_pack.scheduler.simulate import (
    Calibration,
    CalibrationTable,
    Prediction,
    Schedule,
    fit_calibration,
    kernel_path,
    load_calibration,
    predict,
    simulate_schedule,
)
from flamia_pack.scheduler.worklist import (
    ITEM_COLUMNS,
    TileConfig,
    WorkList,
    WorkListBuilder,
    build_work_list,
    build_work_list_host,
    build_work_list_numba,
    max_work_items,
    static_assignment,
)
from flamia_pack.scheduler.workloads import WORKLOADS, lognormal_lengths, workload_lengths

__all__ = [
    "ITEM_COLUMNS",
    "WORKLOADS",
    "Calibration",
    "CalibrationTable",
    "Prediction",
    "Schedule",
    "TileConfig",
    "WorkList",
    "WorkListBuilder",
    "attention_flops",
    "build_work_list",
    "build_work_list_host",
    "build_work_list_numba",
    "choose_policy",
    "fit_calibration",
    "kernel_path",
    "load_calibration",
    "lognormal_lengths",
    "max_work_items",
    "predict",
    "simulate_schedule",
    "static_assignment",
    "tile_count",
    "visible_pairs",
    "workload_lengths",
]
