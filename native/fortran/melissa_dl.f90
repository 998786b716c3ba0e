! Fortran module over the melissa_dl C library (include/melissa_dl.h).
!
!     use mpi_f08
!     use melissa_dl
!     real(real64), allocatable :: p(:)
!     real(real64) :: initial
!     ierr = melissa_dl_parameters(p)                          ! this simulation's parameter set
!     ierr = melissa_dl_parameter("initial", initial)          ! one of them, by its name in the study
!     ierr = melissa_dl_init("temperature", MELISSA_DL_FLOAT32, size(u), MPI_COMM_WORLD)
!     do t = 0, steps - 1
!        ierr = melissa_dl_send("temperature", t, u)           ! u: real(real32), any rank
!     end do
!     ierr = melissa_dl_finalize()
!
! A persistent worker (launcher.persistent: true) runs simulation after
! simulation in one process, asking for each (the same loop runs the single
! simulation of its environment without it; see melissa_dl_next in
! melissa_dl.h):
!
!     logical :: more
!     do
!        ierr = melissa_dl_next(MPI_COMM_WORLD, more)        ! MPI_COMM_NULL: a serial program
!        if (ierr /= MELISSA_DL_OK .or. .not. more) exit
!        ierr = melissa_dl_parameters(p)                       ! this simulation's
!        ierr = melissa_dl_init(...); sends; ierr = melissa_dl_finalize()
!     end do
!
! A domain-decomposed code declares its block of a field instead, in its own
! axis order (start: 0-based offsets of the block's first element in the
! global array), and sends its array as it is, column-major; the field has the
! code's axis order, field[i, j] = p(i + 1, j + 1) (see melissa_dl_init_block
! in melissa_dl.h):
!
!     ierr = melissa_dl_init_block("pressure", MELISSA_DL_FLOAT32, [nx, ny], [i0, j0], [bx, by], MPI_COMM_WORLD)
!     ierr = melissa_dl_send("pressure", t, p(1:bx, 1:by))    ! the interior of an array with halos
!
! Every function returns the C library's status (MELISSA_DL_OK = 0 or one of
! the MELISSA_DL_ERR_* codes) and melissa_dl_error_message() says why a call
! failed. Names are ordinary Fortran strings (trailing blanks are dropped);
! communicators are type(MPI_Comm) (mpi_f08) or integer handles (use mpi);
! melissa_dl_send takes a real32 or real64 array of any rank (non-contiguous
! sections are copied) and sends size(data) elements.
module melissa_dl
  use, intrinsic :: iso_c_binding, only: c_char, c_double, c_float, c_int, c_int64_t, c_loc, c_null_char, &
                                         c_null_ptr, c_ptr, c_size_t, c_f_pointer, c_associated
  use mpi_f08, only: MPI_Comm
  implicit none
  private

  integer, parameter, public :: MELISSA_DL_FLOAT32 = 0, MELISSA_DL_FLOAT64 = 1
  integer, parameter, public :: MELISSA_DL_OK = 0, MELISSA_DL_ERR_ENVIRONMENT = 1, MELISSA_DL_ERR_ARGUMENT = 2, &
                                MELISSA_DL_ERR_STATE = 3, MELISSA_DL_ERR_UNDECLARED = 4, &
                                MELISSA_DL_ERR_DTYPE = 5, MELISSA_DL_ERR_COUNT = 6, MELISSA_DL_ERR_REFUSED = 7, &
                                MELISSA_DL_ERR_UNREACHABLE = 8, MELISSA_DL_ERR_PROTOCOL = 9, &
                                MELISSA_DL_ERR_MPI = 10, MELISSA_DL_ERR_SYSTEM = 11
  integer, parameter, public :: MELISSA_DL_ANSWERED = 0, MELISSA_DL_NO_MODEL = 1, MELISSA_DL_NO_ANSWER = 2

  public :: melissa_dl_version, melissa_dl_simulation, melissa_dl_parameters, melissa_dl_parameter, &
            melissa_dl_init, melissa_dl_init_block, melissa_dl_send, melissa_dl_finalize, melissa_dl_next, &
            melissa_dl_error_message, melissa_dl_predict

  interface melissa_dl_init
    module procedure init_f08, init_handle
  end interface

  interface melissa_dl_init_block
    module procedure init_block_f08, init_block_handle
  end interface

  interface melissa_dl_send
    module procedure send_real32, send_real64
  end interface

  interface melissa_dl_next
    module procedure next_f08, next_handle
  end interface

  interface
    function c_version(protocol) bind(C, name="melissa_dl_version") result(text)
      import :: c_int, c_ptr
      integer(c_int), intent(out) :: protocol
      type(c_ptr) :: text
    end function

    function c_error_message() bind(C, name="melissa_dl_error_message") result(text)
      import :: c_ptr
      type(c_ptr) :: text
    end function

    function c_simulation(simulation_id, attempt) bind(C, name="melissa_dl_simulation") result(status)
      import :: c_int
      integer(c_int), intent(out) :: simulation_id, attempt
      integer(c_int) :: status
    end function

    function c_parameters(values, capacity, count) bind(C, name="melissa_dl_parameters") result(status)
      import :: c_int, c_ptr
      type(c_ptr), value :: values
      integer(c_int), value :: capacity
      integer(c_int), intent(out) :: count
      integer(c_int) :: status
    end function

    function c_parameter(name, value) bind(C, name="melissa_dl_parameter") result(status)
      import :: c_char, c_double, c_int
      character(kind=c_char), intent(in) :: name(*)
      real(c_double), intent(out) :: value
      integer(c_int) :: status
    end function

    function c_init(field, dtype, local_count, comm) bind(C, name="melissa_dl_init_fortran") result(status)
      import :: c_char, c_int, c_int64_t
      character(kind=c_char), intent(in) :: field(*)
      integer(c_int), value :: dtype, comm
      integer(c_int64_t), value :: local_count
      integer(c_int) :: status
    end function

    function c_init_block(field, dtype, ndim, global_shape, start, shape, comm) &
        bind(C, name="melissa_dl_init_block_fortran") result(status)
      import :: c_char, c_int, c_int64_t
      character(kind=c_char), intent(in) :: field(*)
      integer(c_int), value :: dtype, ndim, comm
      integer(c_int64_t), intent(in) :: global_shape(*), start(*), shape(*)
      integer(c_int) :: status
    end function

    function c_send(field, time_step, data, count, dtype) bind(C, name="melissa_dl_send_fortran") result(status)
      import :: c_char, c_int, c_int64_t, c_ptr
      character(kind=c_char), intent(in) :: field(*)
      integer(c_int64_t), value :: time_step, count
      type(c_ptr), value :: data
      integer(c_int), value :: dtype
      integer(c_int) :: status
    end function

    function c_finalize() bind(C, name="melissa_dl_finalize") result(status)
      import :: c_int
      integer(c_int) :: status
    end function

    function c_next(comm, more) bind(C, name="melissa_dl_next_fortran") result(status)
      import :: c_int
      integer(c_int), value :: comm
      integer(c_int), intent(out) :: more
      integer(c_int) :: status
    end function

    function c_predict(n, inputs, noutputs, outputs, output_bytes, deadline, status, version) &
        bind(C, name="melissa_dl_predict") result(code)
      import :: c_double, c_int, c_int64_t, c_ptr, c_size_t
      integer(c_size_t), value :: n
      type(c_ptr), intent(in) :: inputs(*)
      integer(c_int), value :: noutputs
      type(c_ptr), intent(in) :: outputs(*)
      integer(c_size_t), intent(in) :: output_bytes(*)
      real(c_double), value :: deadline
      integer(c_int), intent(out) :: status
      integer(c_int64_t), intent(out) :: version
      integer(c_int) :: code
    end function

    function c_strlen(text) bind(C, name="strlen") result(length)
      import :: c_ptr, c_size_t
      type(c_ptr), value :: text
      integer(c_size_t) :: length
    end function
  end interface

contains

  ! A NUL-terminated copy of a Fortran string, without its trailing blanks.
  pure function c_string(text) result(out)
    character(*), intent(in) :: text
    character(kind=c_char, len=len_trim(text) + 1) :: out
    out = trim(text) // c_null_char
  end function

  ! A Fortran copy of a C string.
  function f_string(text) result(out)
    type(c_ptr), intent(in) :: text
    character(:), allocatable :: out
    character(kind=c_char), pointer :: chars(:)
    integer :: i
    if (.not. c_associated(text)) then
      out = ""
      return
    end if
    call c_f_pointer(text, chars, [c_strlen(text)])
    allocate(character(size(chars)) :: out)
    do i = 1, size(chars)
      out(i:i) = chars(i)
    end do
  end function

  ! The library's version, e.g. "0.1.0"; the wire protocol's in protocol if present.
  function melissa_dl_version(protocol) result(version)
    integer, intent(out), optional :: protocol
    character(:), allocatable :: version
    integer(c_int) :: number
    version = f_string(c_version(number))
    if (present(protocol)) protocol = number
  end function

  ! What the last failing call said.
  function melissa_dl_error_message() result(message)
    character(:), allocatable :: message
    message = f_string(c_error_message())
  end function

  ! This simulation's id and attempt (0 on its first launch).
  integer function melissa_dl_simulation(simulation_id, attempt) result(status)
    integer, intent(out) :: simulation_id, attempt
    integer(c_int) :: id, number
    status = c_simulation(id, number)
    simulation_id = id
    attempt = number
  end function

  ! This simulation's parameter set, allocated to its size.
  integer function melissa_dl_parameters(values) result(status)
    real(c_double), allocatable, target, intent(out) :: values(:)
    integer(c_int) :: count, capacity
    status = c_parameters(c_null_ptr, 0_c_int, capacity)
    if (status /= MELISSA_DL_OK) return
    allocate(values(capacity))
    status = c_parameters(c_loc(values), capacity, count)
  end function

  ! This simulation's parameter called name (a name of study.parameters).
  integer function melissa_dl_parameter(name, value) result(status)
    character(*), intent(in) :: name
    real(c_double), intent(out) :: value
    status = c_parameter(c_string(name), value)
  end function

  ! Declare a field: name, dtype, elements this rank sends per step, communicator.
  integer function init_f08(field, dtype, local_count, comm) result(status)
    character(*), intent(in) :: field
    integer, intent(in) :: dtype, local_count
    type(MPI_Comm), intent(in) :: comm
    status = init_handle(field, dtype, local_count, comm%MPI_VAL)
  end function

  integer function init_handle(field, dtype, local_count, comm) result(status)
    character(*), intent(in) :: field
    integer, intent(in) :: dtype, local_count, comm
    status = c_init(c_string(field), int(dtype, c_int), int(local_count, c_int64_t), int(comm, c_int))
  end function

  ! Declare this rank's block of a field split in blocks: the global shape, the block's start (0-based) and its
  ! shape, in the code's axis order; sends then give the block column-major, as a Fortran array lies.
  integer function init_block_f08(field, dtype, global_shape, start, shape, comm) result(status)
    character(*), intent(in) :: field
    integer, intent(in) :: dtype, global_shape(:), start(:), shape(:)
    type(MPI_Comm), intent(in) :: comm
    status = init_block_handle(field, dtype, global_shape, start, shape, comm%MPI_VAL)
  end function

  integer function init_block_handle(field, dtype, global_shape, start, shape, comm) result(status)
    character(*), intent(in) :: field
    integer, intent(in) :: dtype, global_shape(:), start(:), shape(:), comm
    if (size(start) /= size(global_shape) .or. size(shape) /= size(global_shape)) then
      status = c_init_block(c_string(field), int(dtype, c_int), 0_c_int, [0_c_int64_t], [0_c_int64_t], &
                            [0_c_int64_t], int(comm, c_int))  ! refused, in one line naming the field
      return
    end if
    status = c_init_block(c_string(field), int(dtype, c_int), int(size(global_shape), c_int), &
                          int(global_shape, c_int64_t), int(start, c_int64_t), int(shape, c_int64_t), &
                          int(comm, c_int))
  end function

  ! Send this rank's slice of a field at a time step (0, 1, 2, ...).
  integer function send_real32(field, time_step, data) result(status)
    character(*), intent(in) :: field
    integer, intent(in) :: time_step
    real(c_float), intent(in), target, contiguous :: data(..)
    status = c_send(c_string(field), int(time_step, c_int64_t), c_loc(data), int(size(data), c_int64_t), &
                    MELISSA_DL_FLOAT32)
  end function

  integer function send_real64(field, time_step, data) result(status)
    character(*), intent(in) :: field
    integer, intent(in) :: time_step
    real(c_double), intent(in), target, contiguous :: data(..)
    status = c_send(c_string(field), int(time_step, c_int64_t), c_loc(data), int(size(data), c_int64_t), &
                    MELISSA_DL_FLOAT64)
  end function

  ! Announce the steps sent, wait until every server rank has read them all, and close.
  integer function melissa_dl_finalize() result(status)
    status = c_finalize()
  end function

  ! The next simulation this process runs: more is .true. when it has one, .false. once the study is over (and
  ! on failure). Call it on every rank of comm, outside a simulation (before init, after finalize).
  integer function next_f08(comm, more) result(status)
    type(MPI_Comm), intent(in) :: comm
    logical, intent(out) :: more
    status = next_handle(comm%MPI_VAL, more)
  end function

  integer function next_handle(comm, more) result(status)
    integer, intent(in) :: comm
    logical, intent(out) :: more
    integer(c_int) :: flag
    status = c_next(int(comm, c_int), flag)
    more = flag /= 0
  end function

  ! Ask the model the server is training n questions at once (serving.online; melissa_dl_predict in
  ! melissa_dl.h): inputs(i) = c_loc of the model's i-th prediction input, in its declared order, an array of
  ! its shape's reverse then n (p(5, n) for an input of shape (5,)); outputs(j) = c_loc of a buffer for its
  ! j-th output, of output_bytes(j) bytes exactly; deadline in seconds (negative: serving.deadline). status
  ! is MELISSA_DL_ANSWERED (then version: the batches the answering model was trained to), MELISSA_DL_NO_MODEL
  ! or MELISSA_DL_NO_ANSWER.
  integer function melissa_dl_predict(n, inputs, outputs, output_bytes, deadline, status, version) result(code)
    integer, intent(in) :: n
    type(c_ptr), intent(in) :: inputs(:), outputs(:)
    integer(c_int64_t), intent(in) :: output_bytes(:)
    real(c_double), intent(in) :: deadline
    integer, intent(out) :: status
    integer(c_int64_t), intent(out) :: version
    integer(c_int) :: said
    code = c_predict(int(n, c_size_t), inputs, int(size(outputs), c_int), outputs, &
                     int(output_bytes, c_size_t), deadline, said, version)
    status = said
  end function

end module melissa_dl
