"""The .plan grammar, shipped as package data (plandsl.grammar)."""
