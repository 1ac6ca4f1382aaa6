"""The package list, which pyproject.toml cannot state: every hwlib package, plus the top-level kernels/
shipped inside the wheel as hwlib/kernels/ (its sources, package data in pyproject.toml)."""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["hwlib*"]) + ["hwlib.kernels"], package_dir={"hwlib.kernels": "kernels"})
