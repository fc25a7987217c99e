"""One APIRouter per resource: health, cost, runs, calibration, page (HTML)."""
