"""The Streamlit front end of memviz (`streamlit run app`)."""
