"""The study: which simulations run and their states, what training learnt of each, progress, the report and the plots,
and one simulation tried alone.
"""
