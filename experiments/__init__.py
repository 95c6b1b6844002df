"""servetwin package."""
