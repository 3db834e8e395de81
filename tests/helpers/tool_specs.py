"""Two OpenAI function tools with tight JSON schemas (so that a grammar-forced call by the tiny
random model stays short), and each function's schema by name to validate arguments with."""
from __future__ import annotations

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Berlin", "Rome"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "maxLength": 12},
        "limit": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["query"]}}}
TOOLS = [WEATHER, SEARCH]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
