"""Serving: one handler per endpoint family, turning protocol requests into engine requests and back."""
