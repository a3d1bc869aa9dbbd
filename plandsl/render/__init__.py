"""Rendering: meshes, placements, schedules and memory as graphviz DOT, SVG/PNG and HTML."""
