! A Fortran simulation that asks the model the study trains (melissa_dl_predict), for test_predictions.py:
!
!     f_predictor NX NY STEPS RECORD_FOLDER
!
! Sends STEPS steps of "temperature" (NX x NY real32, 100 + 10 t + the first parameter / 10), asking once before
! the first (serial: MPI_COMM_NULL); simulation 0 then asks until a model answers. Writes RECORD_FOLDER/f<id>.txt:
! "first <status>", and for simulation 0 "answered <version> <mean of the field>".
program f_predictor
  use, intrinsic :: iso_c_binding, only: c_double, c_float, c_int64_t, c_loc, c_ptr
  use, intrinsic :: iso_fortran_env, only: real32, real64
  use mpi_f08, only: MPI_COMM_NULL
  use melissa_dl
  implicit none
  integer :: nx, ny, steps, id, attempt, t, status, unit
  character(len=4096) :: argument, folder
  real(real64), allocatable :: p(:)
  real(c_float), allocatable, target :: field(:, :), answer(:, :)
  real(c_float), target :: parameters(5), time_step(1)
  type(c_ptr) :: inputs(2), outputs(1)
  integer(c_int64_t) :: version
  call get_command_argument(1, argument); read (argument, *) nx
  call get_command_argument(2, argument); read (argument, *) ny
  call get_command_argument(3, argument); read (argument, *) steps
  call get_command_argument(4, folder)
  call check(melissa_dl_simulation(id, attempt))
  call check(melissa_dl_parameters(p))
  allocate (field(ny, nx), answer(ny, nx))  ! C order [nx, ny]: the last axis first
  parameters = real(p(1:5), c_float)
  time_step = real(steps - 1, c_float)
  inputs = [c_loc(parameters), c_loc(time_step)]
  outputs = [c_loc(answer)]
  write (argument, '(a, "/f", i0, ".txt")') trim(folder), id
  open (newunit=unit, file=trim(argument), status="replace")
  call check(melissa_dl_init("temperature", MELISSA_DL_FLOAT32, nx * ny, MPI_COMM_NULL))
  call check(melissa_dl_predict(1, inputs, outputs, [int(4 * nx * ny, c_int64_t)], 60d0, status, version))
  write (unit, '("first ", i0)') status
  do t = 0, steps - 1
    field = real(100 + 10 * t + p(1) / 10, c_float)
    call check(melissa_dl_send("temperature", t, field))
  end do
  if (id == 0) then
    do
      call check(melissa_dl_predict(1, inputs, outputs, [int(4 * nx * ny, c_int64_t)], 60d0, status, version))
      if (status == MELISSA_DL_ANSWERED) exit
      call sleep(1)  ! no model yet
    end do
    write (unit, '("answered ", i0, " ", f0.3)') version, sum(real(answer, real64)) / (nx * ny)
  end if
  close (unit)
  call check(melissa_dl_finalize())

contains

  subroutine check(code)
    integer, intent(in) :: code
    if (code /= MELISSA_DL_OK) then
      write (*, '("f_predictor: ", i0, " ", a)') code, melissa_dl_error_message()
      stop 1
    end if
  end subroutine

end program f_predictor
