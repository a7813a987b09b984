"""The MADE base: its options and order schedule, learner loop, and decomposed layers."""
