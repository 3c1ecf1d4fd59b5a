-- the databases besides POSTGRES_DB (airflow): MLflow's backend store and its basic-auth users (prod_stack.DATABASES)
CREATE DATABASE mlflow;
CREATE DATABASE mlflow_auth;
