"""Package discovery: every package under src/, plus the shipped adapters (adapters/) as
``sdadapt.adapters``. The rest of the metadata is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    package_dir={"": "src", "sdadapt.adapters": "adapters"},
    packages=find_packages("src") + ["sdadapt.adapters"] + [f"sdadapt.adapters.{p}" for p in find_packages("adapters")],
)
