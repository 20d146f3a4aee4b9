"""Plain helper modules shared by test modules (never collected as tests): data and project
templates, ports, scripted stages. Fixtures live in the conftests; a test module imports helpers
from here, never from another test module or a conftest."""
