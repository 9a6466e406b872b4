"""`kvroute calibrate`: measure live engines (measure.py), fit the simulator's step-time model to
the points (fit.py), and write a hardware profile with the fit's error at every point."""

from kvroute.calibrate.fit import fit_profile, write_profile
from kvroute.calibrate.measure import CalibrationError, Measurements, Sweep, measure

__all__ = ["CalibrationError", "Measurements", "Sweep", "fit_profile", "measure", "write_profile"]
