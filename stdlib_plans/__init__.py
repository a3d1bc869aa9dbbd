"""The plandsl standard library of .plan files, shipped as package data (plandsl.stdlib_plans)."""
